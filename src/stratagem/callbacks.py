"""stratagem.callbacks: the callbacks of ``stratagem.train.callbacks`` under their public name."""

from stratagem.train.callbacks import *  # noqa: F403
from stratagem.train.callbacks import __all__  # noqa: F401
from stratagem.train.loggers import MLflowLogger, WandbLogger
from stratagem.train.schedules import ReduceLROnPlateau, TerminateOnNaN

__all__ = [*__all__, "MLflowLogger", "ReduceLROnPlateau", "TerminateOnNaN", "WandbLogger"]
