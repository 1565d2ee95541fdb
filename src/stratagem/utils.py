"""stratagem.utils: Keras's ``keras.utils`` names that have a meaning here (``Sequence`` /
``PyDataset``, from ``stratagem.train.sequence``)."""

from stratagem.train.sequence import PyDataset, Sequence

__all__ = ["PyDataset", "Sequence"]
