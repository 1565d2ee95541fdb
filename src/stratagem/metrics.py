"""stratagem.metrics: the metrics of ``stratagem.train.metrics`` under their public name."""

from stratagem.train.metrics import *  # noqa: F403
from stratagem.train.metrics import __all__  # noqa: F401
