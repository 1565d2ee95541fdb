"""stratagem.utils: Keras's ``keras.utils`` names that have a meaning here (``Sequence`` /
``PyDataset``, from ``stratagem.train.sequence``; ``register_keras_serializable``)."""

from stratagem.train.keras_model import register_keras_serializable
from stratagem.train.sequence import PyDataset, Sequence

__all__ = ["PyDataset", "Sequence", "register_keras_serializable"]
