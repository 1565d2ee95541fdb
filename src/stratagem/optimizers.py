"""stratagem.optimizers: Keras's optimizers (recipes built over a model's parameters by
``Model.compile``) and learning-rate schedules (``stratagem.optimizers.schedules``), from
``stratagem.train.optimizers``."""

from stratagem.train.optimizers import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    CosineDecay,
    ExponentialDecay,
    InverseTimeDecay,
    LearningRateSchedule,
    Optimizer,
    PiecewiseConstantDecay,
    PolynomialDecay,
    RMSprop,
    get,
    schedules,
)

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "CosineDecay",
    "ExponentialDecay",
    "InverseTimeDecay",
    "LearningRateSchedule",
    "Optimizer",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "RMSprop",
    "get",
    "schedules",
]
