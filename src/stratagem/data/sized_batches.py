"""Batches of other shapes: rebatch (one size or a cycle of sizes) and sparse_batch (torch
sparse COO tensors, tf's SparseTensor layout)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

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


class SparseBatchDataset(Dataset):
    """``sparse_batch(batch_size, row_shape)``: ``batch_size`` elements (tensors of any shape
    within ``row_shape``) as one sparse COO tensor of shape ``[n, *row_shape]`` holding every
    entry of every element (zeros included), in row-major order, as tf.data's SparseTensor."""

    def __init__(self, input_ds: Dataset, batch_size: int, row_shape: Sequence[int]) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"sparse_batch: batch_size must be >= 1, got {batch_size}")
        self._row_shape = [int(d) for d in row_shape]
        if any(d < 0 for d in self._row_shape):
            raise ValueError(f"sparse_batch: row_shape must be known sizes >= 0, got {row_shape}")
        self._inputs = (input_ds,)
        self._batch_size = int(batch_size)
        self._plain = BatchDataset(input_ds, int(batch_size), False)

    def _cardinality(self) -> int:
        return self._plain._cardinality()

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _SparseBatchIterator(self._inputs[0]._make_iterator(ctx.child(0)), self)

    def collate(self, elements: list[Any]) -> torch.Tensor:
        indices, values = [], []
        for i, x in enumerate(elements):
            t = torch.as_tensor(x)
            if t.ndim != len(self._row_shape) or any(
                    a > b for a, b in zip(t.shape, self._row_shape)):
                raise ValueError(
                    f"sparse_batch: element of shape {tuple(t.shape)} does not fit row_shape "
                    f"{self._row_shape}"
                )
            grid = np.indices(tuple(t.shape)).reshape(t.ndim, -1).T
            indices.append(np.concatenate([np.full((len(grid), 1), i), grid], axis=1))
            values.append(t.reshape(-1))
        index = torch.from_numpy(np.concatenate(indices).astype(np.int64).T.copy())
        shape = (len(elements), *self._row_shape)
        return torch.sparse_coo_tensor(index, torch.cat(values), shape,
                                       check_invariants=True).coalesce()


class _SparseBatchIterator(StatefulIterator):
    def __init__(self, child: StatefulIterator, ds: SparseBatchDataset) -> None:
        self.child, self.children, self.ds = child, [child], ds

    def __next__(self) -> Any:
        elements = []
        for _ in range(self.ds._batch_size):
            try:
                elements.append(next(self.child))
            except StopIteration:
                break
        if not elements:
            raise StopIteration
        return self.ds.collate(elements)

    def state_dict(self) -> dict[str, Any]:
        return {"input": self.child.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])
