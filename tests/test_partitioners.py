"""Partitioners compute tf's shard counts; shard_bounds splits rows as tf's ShardedVariable does.

Every expected value below was worked by hand from tf's code (tensorflow/python/distribute/
sharded_variable.py, which calls partitioned_variables.min_max_variable_partitioner and
variable_axis_size_partitioner; the row split is parameter_server_strategy_v2's "div" offsets);
the comments show the arithmetic. Cases marked "tf docstring" are tf's own examples.
"""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from stratagem.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    shard_bounds,
)

F32, F16, F64, I64 = torch.float32, torch.float16, torch.float64, torch.int64


@pytest.mark.parametrize(
    "num_shards,shape,axis,expected",
    [
        (2, [10, 3], 0, [2, 1]),  # tf docstring
        (5, [3, 4], 0, [3, 1]),  # min(num_shards=5, shape[0]=3)
        (3, [4, 10], 1, [1, 3]),  # along axis 1: min(3, 10)
        (3, [4, 10], -1, [1, 3]),  # a negative axis counts from the end (tf indexes the list with it)
        (4, [7], 0, [4]),
        (4, [0, 3], 0, [0, 1]),  # min(4, 0): tf returns 0 (its strategy then refuses it)
    ],
)
def test_fixed_shards(num_shards, shape, axis, expected):
    assert FixedShardsPartitioner(num_shards)(shape, F32, axis=axis) == expected


@pytest.mark.parametrize(
    "kwargs,shape,dtype,axis,expected",
    [
        (dict(min_shard_bytes=4, max_shards=2), [6, 1], F32, 0, [2, 1]),  # tf docstring
        (dict(min_shard_bytes=4, max_shards=10), [6, 1], F32, 0, [6, 1]),  # tf docstring
        # partitioned_variables' docstring: 1024*1024*4 / 256K = 16
        (dict(max_shards=16), [1024, 1024], F32, 0, [16, 1]),
        (dict(max_shards=100), [1024, 1024], F32, 0, [16, 1]),
        (dict(max_shards=8), [1024, 1024], F32, 0, [8, 1]),
        (dict(), [1024, 1024], F32, 0, [1, 1]),  # max_shards defaults to 1
        # 1000*10*2 bytes / 3000 = 6.67 -> ceil 7
        (dict(min_shard_bytes=3000, max_shards=100), [1000, 10], F16, 0, [7, 1]),
        # along axis 1: 2*100*8 / 100 = 16; min(100, 50, 16)
        (dict(min_shard_bytes=100, max_shards=50), [2, 100], I64, 1, [1, 16]),
        # capped at the axis length: 3*1000*4 / 4 = 3000; min(3, 100, 3000)
        (dict(min_shard_bytes=4, max_shards=100), [3, 1000], F32, 0, [3, 1]),
        # an empty table: ceil(0) = 0, min(0, ..) = 0, then max(1, 0)
        (dict(min_shard_bytes=4, max_shards=4), [0, 5], F32, 0, [1, 1]),
        # the benchmark's table: 1M*32*4 / 256K = 488.28 -> 489; min(1M, 4, 489)
        (dict(max_shards=4), [1_000_000, 32], F32, 0, [4, 1]),
    ],
)
def test_min_size(kwargs, shape, dtype, axis, expected):
    assert MinSizePartitioner(**kwargs)(shape, dtype, axis=axis) == expected


@pytest.mark.parametrize(
    "kwargs,shape,dtype,axis,expected",
    [
        (dict(max_shard_bytes=4), [6, 1], F32, 0, [6, 1]),  # tf docstring
        (dict(max_shard_bytes=4, max_shards=2), [6, 1], F32, 0, [2, 1]),  # tf docstring
        (dict(max_shard_bytes=1024), [6, 1], F32, 0, [1, 1]),  # tf docstring
        # a row is 32*4 = 128 bytes; floor(4096/128) = 32 rows a shard; ceil(1000/32) = 32
        (dict(max_shard_bytes=4096), [1000, 32], F32, 0, [32, 1]),
        # a row (400 bytes) is over the limit: one row a shard, max(1, floor(0.25))
        (dict(max_shard_bytes=100), [10, 100], F32, 0, [10, 1]),
        # along axis 1: a slice is 100*8 = 800 bytes; floor(1600/800) = 2; ceil(10/2) = 5
        (dict(max_shard_bytes=1600), [100, 10], F64, 1, [1, 5]),
        # tf's suggested limit (64 << 20) - 1 on the benchmark's table: floor(67108863/128) = 524287
        # rows a shard; ceil(1e6/524287) = ceil(1.907) = 2
        (dict(max_shard_bytes=(64 << 20) - 1), [1_000_000, 32], F32, 0, [2, 1]),
        (dict(max_shard_bytes=(64 << 20) - 1), [1_000_000, 32], torch.bfloat16, 0, [1, 1]),
        # max_shards wins over max_shard_bytes
        (dict(max_shard_bytes=4096, max_shards=3), [1000, 32], F32, 0, [3, 1]),
    ],
)
def test_max_size(kwargs, shape, dtype, axis, expected):
    assert MaxSizePartitioner(**kwargs)(shape, dtype, axis=axis) == expected


def test_shapes_may_be_torch_sizes_and_tuples():
    assert FixedShardsPartitioner(2)(torch.Size([10, 3]), F32) == [2, 1]
    assert MaxSizePartitioner(4)((6, 1), F32) == [6, 1]


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: FixedShardsPartitioner(0), "num_shards` must be positive, got 0"),
        (lambda: MinSizePartitioner(min_shard_bytes=0), "min_shard_bytes` must be positive, got 0"),
        (lambda: MinSizePartitioner(max_shards=0), "max_shards` must be positive, got 0"),
        (lambda: MinSizePartitioner(bytes_per_string=-1), "bytes_per_string` must be positive, got -1"),
        (lambda: MaxSizePartitioner(0), "max_shard_bytes` must be positive, got 0"),
        (lambda: MaxSizePartitioner(4, max_shards=-2), "max_shards` must be positive, got -2"),
        (lambda: MaxSizePartitioner(4, max_shards=0), "max_shards` must be positive, got 0"),
        (lambda: MaxSizePartitioner(4, bytes_per_string=0), "bytes_per_string` must be positive, got 0"),
    ],
)
def test_bad_arguments_are_value_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_arguments_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"num_shards` must be an int, got 2.0 \(float\)"):
        FixedShardsPartitioner(2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a torch.dtype"):
        MinSizePartitioner(max_shards=2)([4, 4], "float32")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "partitioner", [FixedShardsPartitioner(2), MinSizePartitioner(4, 4), MaxSizePartitioner(4)]
)
def test_bad_shapes_and_axes(partitioner):
    with pytest.raises(ValueError, match=r"axis 2 a shape of rank 2 \(4, 4\)"):
        partitioner([4, 4], F32, axis=2)
    with pytest.raises(ValueError, match="axis -3"):
        partitioner([4, 4], F32, axis=-3)
    with pytest.raises(ValueError, match="cannot partition a scalar"):
        partitioner([], F32)
    with pytest.raises(ValueError, match=r"fully defined non-negative ints, got \(4, -1\)"):
        partitioner([4, -1], F32)


def test_max_size_refuses_an_empty_shape():
    with pytest.raises(ValueError, match=r"empty shape \(0, 3\)"):
        MaxSizePartitioner(4)([0, 3], F32)  # tf divides by zero


def test_partitioner_is_an_abstract_base():
    with pytest.raises(TypeError):
        Partitioner()  # type: ignore[abstract]

    class Halves(Partitioner):
        def __call__(self, shape, dtype, axis=0):
            return [2 if i == axis else 1 for i in range(len(shape))]

    assert Halves()([4, 4], F32, axis=1) == [1, 2]
    assert isinstance(MaxSizePartitioner(4), Partitioner)


@pytest.mark.parametrize(
    "rows,shards,expected",
    [
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),  # tf's comment: partitions [3, 3, 2, 2]
        (12, 3, [(0, 4), (4, 8), (8, 12)]),
        (7, 1, [(0, 7)]),
        (3, 5, [(0, 1), (1, 2), (2, 3)]),  # min(num_partitions, shape[0]) shards
        (1_000_000, 3, [(0, 333_334), (333_334, 666_667), (666_667, 1_000_000)]),
    ],
)
def test_shard_bounds(rows, shards, expected):
    assert shard_bounds(rows, shards) == expected


def test_shard_bounds_errors():
    with pytest.raises(ValueError, match="num_rows` must be positive, got 0"):
        shard_bounds(0, 2)
    with pytest.raises(ValueError, match="num_shards` must be positive, got 0"):
        shard_bounds(5, 0)


def test_public_names():
    assert sg.partitioners.FixedShardsPartitioner is FixedShardsPartitioner
    assert set(sg.partitioners.__all__) == {
        "Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner", "shard_bounds",
    }
    assert repr(MaxSizePartitioner(4)) == "MaxSizePartitioner(max_shard_bytes=4, max_shards=None, bytes_per_string=16)"
