"""tf.data semantics, as tables of cases checked against outputs the tf.data docs give."""

import pytest
import torch

from stratagem.data import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
)

D = Dataset


def as_lists(ds):
    out = []
    for e in ds:
        if isinstance(e, torch.Tensor):
            out.append(e.tolist())
        elif isinstance(e, tuple):
            out.append(tuple(x.tolist() if isinstance(x, torch.Tensor) else x for x in e))
        else:
            out.append(e)
    return out


# Each row: (description, pipeline, expected) -- expected outputs as printed in the
# tf.data API docs (tf.data.Dataset.<method> examples) unless noted.
CASES = [
    ("range(5)", lambda: D.range(5), [0, 1, 2, 3, 4]),
    ("range(2, 5)", lambda: D.range(2, 5), [2, 3, 4]),
    ("range(1, 5, 2)", lambda: D.range(1, 5, 2), [1, 3]),
    ("range(5, 1, -2)", lambda: D.range(5, 1, -2), [5, 3]),
    ("from_tensor_slices([1,2,3])", lambda: D.from_tensor_slices([1, 2, 3]), [1, 2, 3]),
    ("from_tensor_slices tuple", lambda: D.from_tensor_slices(([1, 2], [3, 4])), [(1, 3), (2, 4)]),
    ("repeat(3)", lambda: D.from_tensor_slices([1, 2, 3]).repeat(3),
     [1, 2, 3, 1, 2, 3, 1, 2, 3]),
    ("take(3)", lambda: D.range(10).take(3), [0, 1, 2]),
    ("skip(7)", lambda: D.range(10).skip(7), [7, 8, 9]),
    ("take(-1)", lambda: D.range(3).take(-1), [0, 1, 2]),
    ("repeat(2).take(5)", lambda: D.range(3).repeat(2).take(5), [0, 1, 2, 0, 1]),
    ("shard(3, 0)", lambda: D.range(10).shard(3, 0), [0, 3, 6, 9]),
    ("shard(3, 1)", lambda: D.range(10).shard(3, 1), [1, 4, 7]),
    ("shard(3, 2)", lambda: D.range(10).shard(3, 2), [2, 5, 8]),
    ("batch(3)", lambda: D.range(8).batch(3), [[0, 1, 2], [3, 4, 5], [6, 7]]),
    ("batch(3, drop_remainder)", lambda: D.range(8).batch(3, drop_remainder=True),
     [[0, 1, 2], [3, 4, 5]]),
    ("enumerate(start=5)", lambda: D.from_tensor_slices([1, 2, 3]).enumerate(start=5),
     [(5, 1), (6, 2), (7, 3)]),
    ("concatenate", lambda: D.range(1, 4).concatenate(D.range(4, 8)), [1, 2, 3, 4, 5, 6, 7]),
    ("zip", lambda: D.zip(D.range(1, 4), D.range(4, 7)), [(1, 4), (2, 5), (3, 6)]),
    ("zip shortest", lambda: D.zip((D.range(1, 4), D.range(7, 9))), [(1, 7), (2, 8)]),
    ("filter", lambda: D.range(1, 6).filter(lambda x: x < 3), [1, 2]),
    ("map", lambda: D.range(1, 6).map(lambda x: x * 2), [2, 4, 6, 8, 10]),
    ("flat_map", lambda: D.from_tensor_slices([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
     .flat_map(D.from_tensor_slices), [1, 2, 3, 4, 5, 6, 7, 8, 9]),
    ("unbatch", lambda: D.range(7).batch(3).unbatch().map(int), [0, 1, 2, 3, 4, 5, 6]),
    ("interleave cycle=2 block=4 (tf docs)",
     lambda: D.range(1, 6).interleave(lambda x: D.from_tensors(x).repeat(6),
                                      cycle_length=2, block_length=4),
     [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 3, 3, 4, 4,
      5, 5, 5, 5, 5, 5]),
    ("interleave parallel, same order",
     lambda: D.range(1, 6).interleave(lambda x: D.from_tensors(x).repeat(6),
                                      cycle_length=2, block_length=4,
                                      num_parallel_calls=AUTOTUNE),
     [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 3, 3, 4, 4,
      5, 5, 5, 5, 5, 5]),
    ("interleave cycle=3 block=1 (uneven)",
     lambda: D.range(1, 4).interleave(lambda x: D.range(x), cycle_length=3, block_length=1),
     [0, 0, 0, 1, 1, 2]),
    ("padded_batch(2) (tf docs)",
     lambda: D.range(1, 5).map(lambda x: torch.full((x,), x)).padded_batch(2),
     [[[1, 0], [2, 2]], [[3, 3, 3, 0], [4, 4, 4, 4]]]),
    ("padded_batch(2, padded_shapes=5) (tf docs)",
     lambda: D.range(1, 5).map(lambda x: torch.full((x,), x)).padded_batch(2, padded_shapes=5),
     [[[1, 0, 0, 0, 0], [2, 2, 0, 0, 0]], [[3, 3, 3, 0, 0], [4, 4, 4, 4, 0]]]),
    ("padded_batch(2, padded_shapes=5, padding_values=-1) (tf docs)",
     lambda: D.range(1, 5).map(lambda x: torch.full((x,), x))
     .padded_batch(2, padded_shapes=5, padding_values=-1),
     [[[1, -1, -1, -1, -1], [2, 2, -1, -1, -1]], [[3, 3, 3, -1, -1], [4, 4, 4, 4, -1]]]),
    ("map parallel keeps order", lambda: D.range(20).map(lambda x: x + 1, num_parallel_calls=4),
     list(range(1, 21))),
    ("shuffle(1) is identity", lambda: D.range(5).shuffle(1), [0, 1, 2, 3, 4]),
    ("prefetch", lambda: D.range(5).prefetch(2), [0, 1, 2, 3, 4]),
    ("cache in memory", lambda: D.range(4).cache(), [0, 1, 2, 3]),
    ("empty repeat", lambda: D.range(0).repeat(), []),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name,make,expected", CASES, ids=[c[0] for c in CASES])
def test_tf_semantics(name, make, expected):
    assert as_lists(make()) == expected


CARDINALITY = [
    (lambda: D.range(42), 42),
    (lambda: D.range(42).repeat(), INFINITE_CARDINALITY),
    (lambda: D.range(42).repeat().take(5), 5),
    (lambda: D.range(42).filter(lambda x: True), UNKNOWN_CARDINALITY),
    (lambda: D.range(10).batch(3), 4),
    (lambda: D.range(10).batch(3, drop_remainder=True), 3),
    (lambda: D.range(10).shard(3, 1), 3),
    (lambda: D.range(10).skip(20), 0),
    (lambda: D.range(3).concatenate(D.range(4)), 7),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("make,expected", CARDINALITY)
def test_cardinality(make, expected):
    assert make().cardinality() == expected


@pytest.mark.timeout(10)
def test_len_and_plain_loop():
    ds = D.range(10).batch(4)
    assert len(ds) == 3
    assert [b.shape[0] for b in ds] == [4, 4, 2]
    with pytest.raises(TypeError, match="infinite"):
        len(D.range(3).repeat())


@pytest.mark.timeout(10)
def test_shuffle_buffer_semantics():
    for seed in range(5):
        out = list(D.range(50).shuffle(10, seed=seed))
        assert sorted(out) == list(range(50))
        # an element can only come out once it has entered the buffer of 10
        assert all(x <= i + 9 for i, x in enumerate(out))
    a = D.range(50).shuffle(10, seed=1)
    assert list(a) != list(a), "each iteration reshuffles without set_epoch"
    b = D.range(50).shuffle(10, seed=1, reshuffle_each_iteration=False)
    assert list(b) == list(b)
    epochs = list(D.range(20).shuffle(20, seed=2).repeat(2))
    assert epochs[:20] != epochs[20:] and sorted(epochs[:20]) == sorted(epochs[20:])
    # same seed, fresh dataset objects: same order
    assert list(D.range(30).shuffle(8, seed=4)) == list(D.range(30).shuffle(8, seed=4))


@pytest.mark.timeout(10)
def test_batch_structures_become_tensors():
    ds = D.from_tensor_slices({"x": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "y": [0, 1, 2]})
    (b,) = list(ds.batch(3))
    assert isinstance(b["x"], torch.Tensor) and b["x"].shape == (3, 2)
    assert b["y"].tolist() == [0, 1, 2]
    (s,) = list(D.from_tensor_slices(["a", "bb"]).batch(2))
    assert list(s) == ["a", "bb"]


@pytest.mark.timeout(10)
def test_options_merge():
    from stratagem.data import AutoShardPolicy, Options

    o = Options()
    o.deterministic = False
    o.autotune.ram_budget = 1 << 20
    p = Options()
    p.distribute.auto_shard_policy = AutoShardPolicy.DATA
    ds = D.range(3).with_options(o).map(lambda x: x).with_options(p)
    merged = ds.options()
    assert merged.deterministic is False
    assert merged.autotune.ram_budget == 1 << 20
    assert merged.distribute.auto_shard_policy == AutoShardPolicy.DATA
    assert D.range(3).options().resolved_auto_shard_policy == AutoShardPolicy.AUTO


@pytest.mark.timeout(10)
def test_nondeterministic_map_is_a_permutation():
    import time

    def slow_first(x):
        if x == 0:
            time.sleep(0.2)
        return x

    out = list(D.range(8).map(slow_first, num_parallel_calls=4, deterministic=False))
    assert sorted(out) == list(range(8))
    assert out[0] != 0, "a slow element is overtaken when deterministic=False"


@pytest.mark.timeout(10)
def test_element_rng_independent_of_parallelism():
    from helpers import noisy

    def run(n):
        ds = D.range(12).map(noisy, num_parallel_calls=n, with_rng=True, seed=5)
        return [t.tolist() for t in ds.iterator(epoch=0)]

    seq = [t.tolist() for t in D.range(12).map(noisy, with_rng=True, seed=5).iterator(epoch=0)]
    assert run(1) == run(4) == seq
    e1 = [t.tolist() for t in D.range(12).map(noisy, with_rng=True, seed=5).iterator(epoch=1)]
    assert e1 != seq, "a new epoch draws new random numbers"
