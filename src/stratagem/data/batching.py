"""batch, padded_batch and unbatch: stacking nested elements into tensors and back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from stratagem.data.structure import (
    describe,
    flatten,
    flatten_up_to,
    pack_as,
    shape_of,
    text_array,
)


def _as_tensor(leaf: Any) -> torch.Tensor:
    if isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(leaf))
    return torch.as_tensor(leaf)


def _is_text(leaf: Any) -> bool:
    return isinstance(leaf, str | bytes) or (
        isinstance(leaf, np.ndarray | np.generic) and np.asarray(leaf).dtype.kind in "USO"
    )


Alloc = Callable[[tuple[int, ...], torch.dtype], "torch.Tensor | None"]


def _normalize_shape(shape: Any) -> list[int] | None:
    if shape is None:
        return None
    if isinstance(shape, int):
        return [shape]
    return [-1 if d is None else int(d) for d in shape]


def stack(
    leaves: list[Any],
    *,
    component: int,
    example: Any,
    padded: bool = False,
    padded_shape: list[int] | None = None,
    padding_value: Any = None,
    alloc: Alloc | None = None,
) -> Any:
    """Stack one component of a batch; strings become a numpy string array.

    ``alloc(shape, dtype)`` may provide the output tensor (a shared-memory region), or None.
    """
    if _is_text(leaves[0]):
        return text_array(leaves)
    tensors = [_as_tensor(x) for x in leaves]
    shapes = [tuple(t.shape) for t in tensors]
    if not padded:
        if len(set(shapes)) > 1:
            j = next(j for j, s in enumerate(shapes) if s != shapes[0])
            raise ValueError(
                f"batch: cannot stack elements of different shapes: element 0 has shape "
                f"{shapes[0]} but element {j} has shape {shapes[j]} (component {component} of "
                f"{describe(example)}); use padded_batch(batch_size) to pad them to a common "
                "shape, or map them to one shape first"
            )
        if alloc is not None and all(
            t.dtype == tensors[0].dtype and not t.requires_grad for t in tensors
        ):
            out = alloc((len(tensors), *shapes[0]), tensors[0].dtype)
            if out is not None:
                return torch.stack(tensors, out=out)
        return torch.stack(tensors)
    rank = len(shapes[0])
    if any(len(s) != rank for s in shapes):
        raise ValueError(f"padded_batch: component {component} has different ranks: {shapes}")
    target = [max(s[d] for s in shapes) for d in range(rank)]
    if padded_shape is not None:
        if len(padded_shape) != rank:
            raise ValueError(
                f"padded_batch: padded shape {padded_shape} has rank {len(padded_shape)} but "
                f"component {component} has shape {shapes[0]}"
            )
        for d, want in enumerate(padded_shape):
            if want >= 0:
                if target[d] > want:
                    raise ValueError(
                        f"padded_batch: an element of component {component} has size "
                        f"{target[d]} in dimension {d}, larger than padded shape {padded_shape}"
                    )
                target[d] = want
    value = 0 if padding_value is None else padding_value
    out = torch.full((len(tensors), *target), value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        index: tuple[Any, ...] = (i, *(slice(0, n) for n in t.shape))
        out[index] = t
    return out


class BatchDataset(Dataset):
    """``batch``/``padded_batch``: ``batch_size`` consecutive elements stacked leaf-wise."""

    def __init__(
        self,
        input_ds: Dataset,
        batch_size: int,
        drop_remainder: bool,
        padded: bool = False,
        padded_shapes: Any = None,
        padding_values: Any = None,
    ) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch: batch_size must be >= 1, got {batch_size}")
        self._inputs = (input_ds,)
        self.batch_size, self.drop_remainder = int(batch_size), bool(drop_remainder)
        self._padded, self._padded_shapes, self._padding_values = (
            padded, padded_shapes, padding_values,
        )

    def _cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if n < 0:
            return n
        return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        from stratagem.data import batch_workers

        segment = batch_workers.find_segment(self)
        if segment is not None:
            workers = segment.pm.batch_workers(batch_workers.pm_context(segment, ctx))
            if workers:  # the parallel map runs on processes: they build whole batches
                return batch_workers.BatchWorkersIterator(segment, ctx, workers)
        return _BatchIterator(self._inputs[0]._make_iterator(ctx.child(0)), self)

    def collate(self, elements: list[Any], alloc: Alloc | None = None) -> Any:
        example = elements[0]
        flats = [flatten(e) for e in elements]
        n = len(flats[0])
        for i, f in enumerate(flats):
            if len(f) != n:
                raise ValueError(
                    f"batch: element {i} has structure {describe(elements[i])}, element 0 has "
                    f"{describe(example)}; all elements of a batch need the same structure"
                )
        shapes: list[Any] = [None] * n
        values: list[Any] = [None] * n
        if self._padded:
            if self._padded_shapes is not None:
                shapes = flatten_up_to(example, self._padded_shapes, "padded_batch: padded_shapes")
            if self._padding_values is not None:
                pv = self._padding_values
                values = (flatten_up_to(example, pv, "padded_batch: padding_values")
                          if isinstance(pv, tuple | dict) else [pv] * n)
        return pack_as(example, [
            stack(
                [f[j] for f in flats], component=j, example=example, padded=self._padded,
                padded_shape=_normalize_shape(shapes[j]), padding_value=values[j],
                alloc=alloc,
            )
            for j in range(n)
        ])


class _BatchIterator(StatefulIterator):
    def __init__(self, child: StatefulIterator, ds: BatchDataset) -> None:
        self.child, self.children, self.ds = child, [child], ds

    def __next__(self) -> Any:
        elements = []
        for _ in range(self.ds.batch_size):
            try:
                elements.append(next(self.child))
            except StopIteration:
                break
        if not elements or (self.ds.drop_remainder and len(elements) < self.ds.batch_size):
            raise StopIteration
        return self.ds.collate(elements)

    def state_dict(self) -> dict[str, Any]:
        return {"input": self.child.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])


class UnbatchDataset(Dataset):
    """Splits each element along its first dimension into separate elements."""

    def __init__(self, input_ds: Dataset) -> None:
        self._inputs = (input_ds,)

    def _cardinality(self) -> int:
        n = self._inputs[0].cardinality()  # infinite stays infinite (as tf.data)
        return INFINITE_CARDINALITY if n == INFINITE_CARDINALITY else UNKNOWN_CARDINALITY

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _UnbatchIterator(self._inputs[0]._make_iterator(ctx.child(0)))


class _UnbatchIterator(StatefulIterator):
    def __init__(self, child: StatefulIterator) -> None:
        self.child, self.children = child, [child]
        self.batch: Any = None
        self.leaves: list[Any] = []
        self.size = self.index = 0
        self.snap: Any = None

    def _load(self) -> None:
        self.snap = self.child.state_dict()
        self.batch = next(self.child)
        self.leaves = flatten(self.batch)
        scalar = [x for x in self.leaves if not shape_of(x) and not hasattr(x, "__len__") or getattr(x, "ndim", 1) == 0]
        if scalar:
            raise ValueError(
                f"unbatch: {describe(self.batch)} has a scalar component, which has no first "
                "dimension to split; unbatch elements that are batches (e.g. after batch())"
            )
        sizes = {shape_of(x)[0] if shape_of(x) else len(x) for x in self.leaves}
        if len(sizes) != 1:
            raise ValueError(
                f"unbatch: components have different first dimensions in {describe(self.batch)}"
            )
        self.size, self.index = sizes.pop(), 0

    def __next__(self) -> Any:
        while self.batch is None or self.index >= self.size:
            self._load()
        self.index += 1
        return pack_as(self.batch, [x[self.index - 1] for x in self.leaves])

    def state_dict(self) -> dict[str, Any]:
        if self.batch is None or self.index >= self.size:
            return {"input": self.child.state_dict(), "index": 0, "in_batch": False}
        return {"input": self.snap, "index": self.index, "in_batch": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])
        if state["in_batch"]:
            self._load()
            self.index = int(state["index"])
