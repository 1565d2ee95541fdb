"""stratagem.losses: Keras's loss classes and functions (``stratagem.train.losses``) under their
public name. A ``Loss`` is called ``(y_true, y_pred)`` as in Keras; torch losses keep
``(outputs, y)``."""

from stratagem.train.losses import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    Huber,
    Loss,
    LossFunctionWrapper,
    MeanAbsoluteError,
    MeanSquaredError,
    Reduction,
    SparseCategoricalCrossentropy,
    binary_crossentropy,
    categorical_crossentropy,
    get,
    huber,
    mean_absolute_error,
    mean_squared_error,
    sparse_categorical_crossentropy,
)

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Huber",
    "Loss",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Reduction",
    "SparseCategoricalCrossentropy",
    "binary_crossentropy",
    "categorical_crossentropy",
    "get",
    "huber",
    "mean_absolute_error",
    "mean_squared_error",
    "sparse_categorical_crossentropy",
]
