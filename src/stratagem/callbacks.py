"""stratagem.callbacks: the callbacks of ``stratagem.train.callbacks`` under their public name."""

from stratagem.train.callbacks import *  # noqa: F403
from stratagem.train.callbacks import __all__  # noqa: F401
