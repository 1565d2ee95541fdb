"""stratagem.partitioners: tf.distribute.experimental.partitioners (``stratagem.distribute.partitioners``)."""

from stratagem.distribute.partitioners import *  # noqa: F403
from stratagem.distribute.partitioners import __all__  # noqa: F401
