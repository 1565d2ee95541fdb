"""Keras's ``keras.utils.Sequence`` (``PyDataset`` in Keras 3): a dataset of batches by index.

Subclass it with ``__len__`` (the number of batches) and ``__getitem__(index)`` (batch ``index``:
``(x, y)`` or ``(x, y, sample_weight)``), and optionally ``on_epoch_end`` (called after every full
pass, e.g. to reshuffle). ``fit`` / ``evaluate`` / ``predict`` read it as any iterable of global
batches: each pass is ``self[0] ... self[len(self) - 1]``, then ``on_epoch_end()``. Under a
strategy every replica builds the same global batches and keeps its share, so ``__getitem__``
must give the same batch for the same index on every replica (seed any shuffling).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["PyDataset", "Sequence"]


class PyDataset:
    """Keras 3's ``PyDataset`` / TF 2's ``keras.utils.Sequence``: batches by index."""

    def __init__(self, workers: int = 1, use_multiprocessing: bool = False, max_queue_size: int = 10) -> None:
        if workers != 1 or use_multiprocessing:
            raise ValueError(
                "PyDataset(workers=..., use_multiprocessing=...) is not offered: batches are read in the "
                "training process; for parallel loading use stratagem.data (map with num_parallel_calls) "
                "or a torch DataLoader"
            )
        del max_queue_size

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must implement __len__ (the number of batches)")

    def __getitem__(self, index: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __getitem__(index) (batch index)")

    def on_epoch_end(self) -> None:
        """Called after every full pass (override to reshuffle)."""

    @property
    def num_batches(self) -> int:
        return len(self)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]
        self.on_epoch_end()


#: TF 2's name
Sequence = PyDataset
