"""element_spec: TensorSpec / RaggedSpec of a dataset's elements, and conversion to a spec."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from stratagem.data.ragged import Ragged
from stratagem.data.structure import describe, flatten, pack_as, to_tensor

STRING = "string"
"""The dtype of text leaves (``str``/``bytes``, tf.string)."""


def as_dtype(dtype: Any) -> Any:
    """A torch dtype or :data:`STRING` from tf-style spellings (torch/numpy dtypes, names,
    Python types ``int``/``float``/``bool``/``str``/``bytes``)."""
    if isinstance(dtype, torch.dtype) or dtype == STRING:
        return dtype
    if dtype in (str, bytes, "str", "bytes", "tf.string"):
        return STRING
    if dtype is int:
        return torch.int64
    if dtype is float:
        return torch.float32
    if dtype is bool:
        return torch.bool
    name = getattr(dtype, "name", None)  # tf.DType-like objects
    if isinstance(dtype, str) or (name and not isinstance(dtype, np.dtype | type)):
        text = str(name or dtype).replace("tf.", "").replace("torch.", "")
        if text == STRING:
            return STRING
        found = getattr(torch, text, None)
        if isinstance(found, torch.dtype):
            return found
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    if np_dtype is not None:
        if np_dtype.kind in "OSU":
            return STRING
        return torch.from_numpy(np.zeros(0, dtype=np_dtype)).dtype
    raise TypeError(f"not a dtype: {dtype!r}; use a torch dtype or 'string'")


def _dtype_name(dtype: Any) -> str:
    return dtype if dtype == STRING else str(dtype).replace("torch.", "")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape (``None`` for an unknown dimension, or ``shape=None`` for an unknown rank) and
    dtype of a leaf, like ``tf.TensorSpec``."""

    shape: tuple[int | None, ...] | None = ()
    dtype: Any = torch.float32
    name: str | None = None

    def __post_init__(self) -> None:
        if self.shape is not None:
            shape = (self.shape,) if isinstance(self.shape, int) else self.shape
            object.__setattr__(self, "shape", tuple(None if d is None else int(d) for d in shape))
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    def is_compatible_with(self, other: Any) -> bool:
        other_spec = other if isinstance(other, TensorSpec | RaggedSpec) else spec_of(other)
        if not isinstance(other_spec, TensorSpec) or other_spec.dtype != self.dtype:
            return False
        return _shapes_compatible(self.shape, other_spec.shape)

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape}, dtype={_dtype_name(self.dtype)})"


@dataclasses.dataclass(frozen=True)
class RaggedSpec:
    """A :class:`~stratagem.data.ragged.Ragged` leaf: ``shape`` is ``(nrows, None, *inner)``."""

    shape: tuple[int | None, ...] | None = (None, None)
    dtype: Any = torch.float32

    def __post_init__(self) -> None:
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(None if d is None else int(d)
                                                    for d in self.shape))
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    def is_compatible_with(self, other: Any) -> bool:
        other_spec = other if isinstance(other, TensorSpec | RaggedSpec) else spec_of(other)
        return (isinstance(other_spec, RaggedSpec) and other_spec.dtype == self.dtype
                and _shapes_compatible(self.shape, other_spec.shape))

    def __repr__(self) -> str:
        return f"RaggedSpec(shape={self.shape}, dtype={_dtype_name(self.dtype)})"


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A leaf that is itself a dataset (``window``'s elements), like ``tf.data.DatasetSpec``:
    ``element_spec`` is the spec of its elements."""

    element_spec: Any

    def is_compatible_with(self, other: Any) -> bool:
        from stratagem.data.dataset import Dataset

        if isinstance(other, Dataset):
            other = DatasetSpec(static_spec(other) or self.element_spec)
        if not isinstance(other, DatasetSpec):
            return False
        mine, theirs = flatten(self.element_spec), flatten(other.element_spec)
        return len(mine) == len(theirs) and all(
            a.is_compatible_with(b) for a, b in zip(mine, theirs))

    def __repr__(self) -> str:
        return f"DatasetSpec({self.element_spec!r})"


def _shapes_compatible(a: tuple[int | None, ...] | None, b: tuple[int | None, ...] | None
                       ) -> bool:
    if a is None or b is None:
        return True
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


def leaf_spec(leaf: Any) -> TensorSpec | RaggedSpec | DatasetSpec:
    from stratagem.data.dataset import Dataset

    if isinstance(leaf, Dataset):
        return DatasetSpec(leaf.element_spec)
    if isinstance(leaf, Ragged):
        dtype = STRING if isinstance(leaf.values, np.ndarray) else leaf.values.dtype
        return RaggedSpec(leaf.shape, dtype)
    if isinstance(leaf, torch.Tensor):
        return TensorSpec(tuple(leaf.shape), leaf.dtype)
    if isinstance(leaf, np.ndarray | np.generic):
        return TensorSpec(tuple(np.shape(leaf)), as_dtype(leaf.dtype))
    if isinstance(leaf, str | bytes):
        return TensorSpec((), STRING)
    if isinstance(leaf, bool | int | float | complex | list):
        converted = to_tensor(leaf)  # as tf would hold it (int32, float32, ...)
        if not isinstance(converted, list):
            return leaf_spec(converted)
    raise TypeError(f"no TensorSpec for a {type(leaf).__name__} leaf")


def spec_of(element: Any) -> Any:
    """The element's structure with every leaf replaced by its spec."""
    return pack_as(element, [leaf_spec(leaf) for leaf in flatten(element)])


def generalize(a: Any, b: Any) -> Any:
    """The most specific spec compatible with both (dimensions that differ become None)."""
    fa, fb = flatten(a), flatten(b)
    if len(fa) != len(fb):
        raise ValueError(f"different structures: {describe(a)} and {describe(b)}")
    out = []
    for x, y in zip(fa, fb):
        if type(x) is not type(y) or x.dtype != y.dtype:
            raise ValueError(f"incompatible specs {x} and {y}")
        if x.shape is None or y.shape is None or len(x.shape) != len(y.shape):
            out.append(type(x)(None, x.dtype))
            continue
        shape = tuple(p if p == q else None for p, q in zip(x.shape, y.shape))
        out.append(type(x)(shape, x.dtype))
    return pack_as(a, out)


def batched(spec: Any, batch_size: int | None) -> Any:
    """``spec`` with a leading batch dimension (None unless every batch is full)."""
    out: list[Any] = []
    for s in flatten(spec):
        if isinstance(s, RaggedSpec):
            raise ValueError("batch() of Ragged elements is not supported; unbatch them first")
        out.append(TensorSpec(None if s.shape is None else (batch_size, *s.shape), s.dtype))
    return pack_as(spec, out)


def padded(spec: Any, batch_size: int | None, padded_shapes: Any) -> Any:
    """``spec`` as padded_batch gives it: a leading batch dimension, and each dimension the
    padded shape fixes (else unknown: elements of different sizes pad to each batch's
    longest)."""
    from stratagem.data.structure import flatten_up_to

    flat = flatten(spec)
    shapes = ([None] * len(flat) if padded_shapes is None
              else flatten_up_to(spec, padded_shapes, "padded_batch: padded_shapes"))
    out: list[Any] = []
    for s, want in zip(flat, shapes):
        if isinstance(s, RaggedSpec):
            raise ValueError("padded_batch of Ragged elements is not supported")
        if s.shape is None:
            out.append(TensorSpec(None, s.dtype))
            continue
        given = [want] if isinstance(want, int) else list(want) if want is not None else None
        dims = tuple(
            None if given is None or given[d] is None or int(given[d]) < 0 else int(given[d])
            for d in range(len(s.shape))
        )
        out.append(TensorSpec((batch_size, *dims), s.dtype))
    return pack_as(spec, out)


def unbatched(spec: Any) -> Any:
    """``spec`` without its leading dimension (a Ragged's rows are tensors)."""
    return pack_as(spec, [
        TensorSpec(None if s.shape is None else (None, *s.shape[2:]) if isinstance(s, RaggedSpec)
                   else s.shape[1:], s.dtype)
        for s in flatten(spec)
    ])


def element_spec(ds: Any) -> Any:
    """The static spec of ``ds`` where the plan knows it (sources with known values or an
    ``output_signature``, and the transformations that keep or batch it); otherwise the spec of
    the first element (shapes as in that element)."""
    static = static_spec(ds, _first_element_spec)
    if static is not None:
        return static
    return _first_element_spec(ds)


def _first_element_spec(ds: Any) -> Any:
    it = ds.iterator(epoch=0, seed=0)
    try:
        first = next(iter(it), _EMPTY)
    finally:
        it.close()
    if first is _EMPTY:
        raise ValueError(
            "element_spec: the dataset has no static element structure (it maps, filters or "
            "generates without output_signature) and it is empty, so there is no element to "
            "describe; give from_generator an output_signature"
        )
    return spec_of(first)


_EMPTY = object()


def static_spec(ds: Any, fallback: Any = None) -> Any:
    """The spec known from the plan alone, or None. With ``fallback`` (a function of a
    dataset), the nodes whose spec the plan does not know (a map, a generator without
    signature) are asked ``fallback(node)`` and the transformations above them still apply
    (a batch's dimension, padding, concatenation), so the spec holds for every element."""
    from stratagem.data.batching import BatchDataset, UnbatchDataset
    from stratagem.data.prefetch import PrefetchDataset
    from stratagem.data.shuffle import ShuffleDataset
    from stratagem.data.transforms import (
        ConcatenateDataset,
        EnumerateDataset,
        FilterDataset,
        OptionsDataset,
        RepeatDataset,
        ShardDataset,
        SkipDataset,
        TakeDataset,
        ZipDataset,
    )

    own = ds._spec()
    if own is not None:
        return own
    keep = (FilterDataset, OptionsDataset, PrefetchDataset, RepeatDataset, ShardDataset,
            ShuffleDataset, SkipDataset, TakeDataset)
    if isinstance(ds, keep) or type(ds).__name__ == "CacheDataset":
        return static_spec(ds._inputs[0], fallback)
    if isinstance(ds, ConcatenateDataset):
        a, b = (static_spec(d, fallback) for d in ds._inputs)
        return None if a is None or b is None else generalize(a, b)
    if isinstance(ds, EnumerateDataset):
        inner = static_spec(ds._inputs[0], fallback)
        return None if inner is None else (TensorSpec((), torch.int64), inner)
    if isinstance(ds, ZipDataset):
        parts = [static_spec(d, fallback) for d in ds._inputs]
        return None if any(p is None for p in parts) else pack_as(ds._structure, parts)
    if isinstance(ds, BatchDataset):
        inner = static_spec(ds._inputs[0], fallback)
        if inner is None:
            return None
        size = ds.batch_size if ds.drop_remainder else None
        if ds._padded:
            return padded(inner, size, ds._padded_shapes)
        return batched(inner, size)
    if isinstance(ds, UnbatchDataset):
        inner = static_spec(ds._inputs[0], fallback)
        return None if inner is None else unbatched(inner)
    if type(ds).__name__ == "WindowDataset":
        inner = static_spec(ds._inputs[0], fallback)
        return None if inner is None else pack_as(inner, [DatasetSpec(s) for s in flatten(inner)])
    return None if fallback is None else fallback(ds)


def convert(value: Any, spec: Any, what: str, position: int) -> Any:
    """``value`` converted to the structure and dtypes of ``spec``; a ValueError naming the
    element when its structure or shapes do not match."""
    flat_spec = flatten(spec)
    if isinstance(spec, TensorSpec | RaggedSpec):
        # one component: the whole value is its tensor (tf's flatten_up_to), so the guide's
        # ``yield (sample_idx,)`` under TensorSpec(shape=(1,)) is a tensor of shape (1,)
        return pack_as(spec, _convert_leaves([value], flat_spec, spec, what, position))
    if isinstance(spec, tuple) and isinstance(value, list):
        value = tuple(value)
    leaves = flatten(value)
    if len(leaves) != len(flat_spec) or (isinstance(spec, dict) != isinstance(value, dict)):
        raise ValueError(
            f"{what}: element {position} has structure {describe(value)}, but output_signature "
            f"is {spec!r}"
        )
    if isinstance(spec, dict) and sorted(spec) != sorted(value):
        raise ValueError(
            f"{what}: element {position} has keys {sorted(value)}, but output_signature has "
            f"keys {sorted(spec)}"
        )
    return pack_as(spec, _convert_leaves(leaves, flat_spec, spec, what, position))


def _convert_leaves(leaves: list[Any], flat_spec: list[Any], spec: Any, what: str,
                    position: int) -> list[Any]:
    out = []
    for leaf, s in zip(leaves, flat_spec):
        if isinstance(s, RaggedSpec):
            converted: Any = leaf if isinstance(leaf, Ragged) else Ragged.from_rows(list(leaf))
            if isinstance(converted.values, torch.Tensor) and s.dtype != STRING:
                converted = Ragged(converted.values.to(s.dtype), converted.row_splits)
        elif s.dtype == STRING:
            converted = leaf if isinstance(leaf, str | bytes) else np.asarray(leaf)
            if isinstance(converted, np.ndarray) and converted.ndim == 0:
                converted = converted.item()
        else:
            try:
                if isinstance(leaf, torch.Tensor):
                    converted = leaf.to(s.dtype)
                else:
                    converted = torch.as_tensor(np.asarray(leaf), dtype=s.dtype).clone()
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(
                    f"{what}: element {position}: cannot convert {leaf!r} to {s}: {e}"
                ) from e
        got = leaf_spec(converted)
        assert not isinstance(got, DatasetSpec)  # converted leaves are tensors or text
        if not _shapes_compatible(s.shape, got.shape):
            raise ValueError(
                f"{what}: element {position} has a leaf of shape {got.shape}, which is not "
                f"compatible with {s} of output_signature {spec!r}"
            )
        out.append(converted)
    return out
