"""Variable partitioners (pure): how many shards a parameter is split into, with tf's names and arithmetic.

``tf.distribute.experimental.partitioners``: a partitioner is called with a parameter's shape and
dtype and returns the number of partitions on each axis, all 1 but ``axis``. ParameterServerStrategy
splits axis 0 into that many contiguous runs of rows (:func:`shard_bounds`), the first
``num_rows % num_shards`` one row longer, as tf's ``ShardedVariable`` does. The arithmetic is
tf's (``partitioned_variables.min_max_variable_partitioner`` and
``variable_axis_size_partitioner``), float division included, so a shape shards as it would
under tf. torch has no string dtype: ``bytes_per_string`` is kept for tf's signatures and is
used only for a dtype without an item size.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence

import torch

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "shard_bounds",
]


def _positive_int(value: object, name: str, cls: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{cls}: `{name}` must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{cls}: `{name}` must be positive, got {value}")
    return value


def _check_shape(shape: Sequence[int], axis: int, cls: str) -> tuple[list[int], int]:
    """``shape`` as a list of non-negative ints and ``axis`` as a non-negative index into it."""
    dims = list(shape)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"{cls}: shape must be fully defined non-negative ints, got {tuple(shape)!r}")
    if not dims:
        raise ValueError(f"{cls}: cannot partition a scalar (shape ()); partition a shape of rank >= 1")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -len(dims) <= axis < len(dims):
        raise ValueError(
            f"{cls}: cannot partition along axis {axis!r} a shape of rank {len(dims)} {tuple(dims)!r}"
        )
    return dims, axis % len(dims)


def _element_bytes(dtype: torch.dtype, bytes_per_string: int) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r} ({type(dtype).__name__})")
    size = getattr(dtype, "itemsize", 0)
    return int(size) if size else bytes_per_string


class Partitioner(abc.ABC):
    """Partitions a shape: ``partitioner(shape, dtype, axis=0)`` is the number of partitions on each
    axis (a list as long as ``shape``, all 1 but ``axis``)."""

    @abc.abstractmethod
    def __call__(self, shape: Sequence[int], dtype: torch.dtype, axis: int = 0) -> list[int]:
        """The number of partitions on each axis of ``shape``, all 1 but ``axis``."""


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards along ``axis`` (fewer when the axis is shorter: one row each).

    >>> FixedShardsPartitioner(num_shards=2)([10, 3], torch.float32)
    [2, 1]
    """

    def __init__(self, num_shards: int) -> None:
        # tf checks nothing here (a 0 gives 0 partitions, which its strategy then refuses)
        self._num_shards = _positive_int(num_shards, "num_shards", "FixedShardsPartitioner")

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, axis: int = 0) -> list[int]:
        dims, axis = _check_shape(shape, axis, type(self).__name__)
        result = [1] * len(dims)
        result[axis] = min(self._num_shards, dims[axis])
        return result

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """Shards of at least ``min_shard_bytes`` each, as many as that allows, at most ``max_shards``.

    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)([6, 1], torch.float32)
    [2, 1]
    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)([6, 1], torch.float32)
    [6, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16) -> None:
        name = "MinSizePartitioner"
        self._min_shard_bytes = _positive_int(min_shard_bytes, "min_shard_bytes", name)
        self._max_shards = _positive_int(max_shards, "max_shards", name)
        self._bytes_per_string = _positive_int(bytes_per_string, "bytes_per_string", name)

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, axis: int = 0) -> list[int]:
        dims, axis = _check_shape(shape, axis, type(self).__name__)
        total_bytes = math.prod(dims) * _element_bytes(dtype, self._bytes_per_string)
        partitions = total_bytes / self._min_shard_bytes  # tf divides as floats, then ceils
        result = [1] * len(dims)
        result[axis] = max(1, min(dims[axis], self._max_shards, int(math.ceil(partitions))))
        return result

    def __repr__(self) -> str:
        return (
            f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, max_shards={self._max_shards}, "
            f"bytes_per_string={self._bytes_per_string})"
        )


class MaxSizePartitioner(Partitioner):
    """Shards of at most ``max_shard_bytes`` each, as few as that allows; ``max_shards`` (if given)
    takes precedence, so shards may then be larger. A shard holds at least one row.

    >>> MaxSizePartitioner(max_shard_bytes=4)([6, 1], torch.float32)
    [6, 1]
    >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)([6, 1], torch.float32)
    [2, 1]
    >>> MaxSizePartitioner(max_shard_bytes=1024)([6, 1], torch.float32)
    [1, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16) -> None:
        name = "MaxSizePartitioner"
        self._max_shard_bytes = _positive_int(max_shard_bytes, "max_shard_bytes", name)
        # tf lets max_shards=0 through as "no limit" (its check is `if max_shards and ...`); a 0
        # here is refused: None is how to say no limit
        self._max_shards = None if max_shards is None else _positive_int(max_shards, "max_shards", name)
        self._bytes_per_string = _positive_int(bytes_per_string, "bytes_per_string", name)

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, axis: int = 0) -> list[int]:
        name = type(self).__name__
        dims, axis = _check_shape(shape, axis, name)
        if math.prod(dims) == 0:  # tf divides by zero here
            raise ValueError(f"{name}: cannot size shards of an empty shape {tuple(dims)!r}")
        element = _element_bytes(dtype, self._bytes_per_string)
        # tf's arithmetic, in floats: the bytes of one slice along `axis`, how many slices fit in
        # max_shard_bytes (at least one), how many shards the axis then needs
        bytes_per_slice = 1.0 * (math.prod(dims) / dims[axis]) * element
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice))
        axis_shards = int(math.ceil(1.0 * dims[axis] / slices_per_shard))
        if self._max_shards is not None:
            axis_shards = min(self._max_shards, axis_shards)
        result = [1] * len(dims)
        result[axis] = axis_shards
        return result

    def __repr__(self) -> str:
        return (
            f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, max_shards={self._max_shards}, "
            f"bytes_per_string={self._bytes_per_string})"
        )


def shard_bounds(num_rows: int, num_shards: int) -> list[tuple[int, int]]:
    """Each shard's rows ``[start, stop)`` when ``num_rows`` rows are split into ``num_shards``
    contiguous shards as tf's ParameterServerStrategy splits a ShardedVariable: the first
    ``num_rows % num_shards`` shards hold one row more; more shards than rows gives one row each
    (tf caps the count at the number of rows).

    >>> shard_bounds(10, 4)
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    for value, name in ((num_rows, "num_rows"), (num_shards, "num_shards")):
        _positive_int(value, name, "shard_bounds")
    shards = min(num_shards, num_rows)
    base, extra = divmod(num_rows, shards)
    bounds = []
    start = 0
    for i in range(shards):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
