"""ragged_batch: batch elements of different lengths into Ragged values instead of padding."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.ragged import Ragged
from stratagem.data.structure import describe, flatten, pack_as


def _dense_leaf(leaves: list[Any]) -> Any:
    if isinstance(leaves[0], str | bytes) or (
        isinstance(leaves[0], np.ndarray | np.generic) and np.asarray(leaves[0]).dtype.kind in "OSU"
    ):
        out = np.empty(len(leaves), dtype=object)
        out[:] = [np.asarray(x).item() if np.ndim(x) == 0 else x for x in leaves]
        return out
    return torch.stack([torch.as_tensor(x) for x in leaves])


class RaggedBatchDataset(Dataset):
    """``ragged_batch(batch_size, drop_remainder)``: a component of rank >= 1 becomes a
    :class:`~stratagem.data.ragged.Ragged` of the batch's rows; scalars stack into a tensor.

    tf.data keeps a component dense when its static shape is fully known; stratagem does
    that where the plan knows the shape (``element_spec`` without a map in between) and
    otherwise makes every component of rank >= 1 ragged, so a batch's type does not depend on
    whether its rows happen to have equal lengths.
    """

    def __init__(self, input_ds: Dataset, batch_size: int, drop_remainder: bool) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"ragged_batch: batch_size must be >= 1, got {batch_size}")
        self._inputs = (input_ds,)
        self._batch_size, self._drop = int(batch_size), bool(drop_remainder)
        from stratagem.data.spec import TensorSpec, static_spec

        spec = static_spec(input_ds)
        self._dense: list[bool] | None = None
        if spec is not None:
            self._dense = [
                isinstance(s, TensorSpec) and s.shape is not None
                and all(d is not None for d in s.shape)
                for s in flatten(spec)
            ]

    def _spec(self) -> Any:
        from stratagem.data.spec import RaggedSpec, TensorSpec, static_spec

        spec = static_spec(self._inputs[0])
        if spec is None:
            return None
        rows = self._batch_size if self._drop else None
        out: list[Any] = []
        for s, dense in zip(flatten(spec), self._dense or []):
            if s.shape is None:
                return None
            if dense or not s.shape:
                out.append(TensorSpec((rows, *s.shape), s.dtype))
            else:
                out.append(RaggedSpec((rows, None, *s.shape[1:]), s.dtype))
        return pack_as(spec, out)

    def _cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if n < 0:
            return n
        return n // self._batch_size if self._drop else -(-n // self._batch_size)

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _RaggedBatchIterator(self._inputs[0]._make_iterator(ctx.child(0)), self)

    def collate(self, elements: list[Any]) -> Any:
        flats = [flatten(e) for e in elements]
        n = len(flats[0])
        for i, f in enumerate(flats):
            if len(f) != n:
                raise ValueError(
                    f"ragged_batch: element {i} has structure {describe(elements[i])}, element 0 "
                    f"has {describe(elements[0])}; all elements need the same structure"
                )
        out = []
        for j in range(n):
            leaves = [f[j] for f in flats]
            ranks = {int(np.ndim(x)) if not isinstance(x, str | bytes) else 0 for x in leaves}
            if len(ranks) > 1:
                raise ValueError(
                    f"ragged_batch: component {j} has different ranks {sorted(ranks)} in "
                    f"{describe(elements[0])}"
                )
            dense = ranks == {0} or (self._dense is not None and self._dense[j])
            out.append(_dense_leaf(leaves) if dense else Ragged.from_rows(leaves))
        return pack_as(elements[0], out)


class _RaggedBatchIterator(StatefulIterator):
    def __init__(self, child: StatefulIterator, ds: RaggedBatchDataset) -> None:
        self.child, self.children, self.ds = child, [child], ds

    def __next__(self) -> Any:
        elements = []
        for _ in range(self.ds._batch_size):
            try:
                elements.append(next(self.child))
            except StopIteration:
                break
        if not elements or (self.ds._drop and len(elements) < self.ds._batch_size):
            raise StopIteration
        return self.ds.collate(elements)

    def state_dict(self) -> dict[str, Any]:
        return {"input": self.child.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])
