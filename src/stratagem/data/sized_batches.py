"""rebatch: regroup batched elements into batches of one size or of a cycle of sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stratagem.data.batching import BatchDataset
from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY


class CycledBatchDataset(Dataset):
    """Batches of ``sizes[0]``, ``sizes[1]``, ... elements, cycling through ``sizes``."""

    def __init__(self, input_ds: Dataset, sizes: Sequence[int], drop_remainder: bool) -> None:
        sizes = [int(s) for s in sizes]
        if not sizes or min(sizes) < 1:
            raise ValueError(f"rebatch: batch sizes must be >= 1, got {sizes}")
        self._inputs = (input_ds,)
        self._sizes, self._drop = sizes, bool(drop_remainder)
        self._collate = {s: BatchDataset(input_ds, s, drop_remainder) for s in set(sizes)}

    def _cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        return INFINITE_CARDINALITY if n == INFINITE_CARDINALITY else UNKNOWN_CARDINALITY

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _CycledBatchIterator(self._inputs[0]._make_iterator(ctx.child(0)), self)


class _CycledBatchIterator(StatefulIterator):
    def __init__(self, child: StatefulIterator, ds: CycledBatchDataset) -> None:
        self.child, self.children, self.ds = child, [child], ds
        self.k = 0

    def __next__(self) -> Any:
        size = self.ds._sizes[self.k % len(self.ds._sizes)]
        elements = []
        for _ in range(size):
            try:
                elements.append(next(self.child))
            except StopIteration:
                break
        if not elements or (self.ds._drop and len(elements) < size):
            raise StopIteration
        self.k += 1
        return self.ds._collate[size].collate(elements)

    def state_dict(self) -> dict[str, Any]:
        return {"input": self.child.state_dict(), "k": self.k}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])
        self.k = int(state["k"])


def rebatch(dataset: Dataset, batch_size: int | Sequence[int], drop_remainder: bool) -> Dataset:
    """tf.data's ``rebatch``: the elements of the batches, batched again by ``batch_size``
    (an int, or a list of sizes used in turn); the same as ``unbatch().batch(n)``."""
    if isinstance(batch_size, int):
        return dataset.unbatch().batch(batch_size, drop_remainder=drop_remainder)
    return CycledBatchDataset(dataset.unbatch(), list(batch_size), drop_remainder)
