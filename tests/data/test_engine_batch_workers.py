"""Batch-building workers: the same batches as the sequential pipeline, bit for bit, with
resume, errors and killed workers handled (each multi-process test has a timeout)."""

import functools
import itertools
import json
import logging
import multiprocessing
import os
import signal
import time

import engine_helpers as eh
import helpers
import numpy as np
import pytest
import torch

from stratagem.data import (
    AUTOTUNE,
    Dataset,
    MapFunctionError,
    assert_resumes_exactly,
    auto_shard,
)
from stratagem.data import batch_workers as bw
from stratagem.data.testing import to_plain

D = Dataset


def _plain(ds, epoch=0):
    with ds.iterator(epoch=epoch, seed=5) as it:
        return [to_plain(b) for b in it]


def _no_workers_left(timeout=5.0):
    """Workers of an exhausted iterator are joined in the background, within moments."""
    deadline = time.monotonic() + timeout
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not multiprocessing.active_children()


def _uses_batch_workers(ds):
    with ds.iterator(epoch=0) as it:
        return isinstance(it._holder[0], bw.BatchWorkersIterator)


@pytest.mark.timeout(60)
def test_batches_equal_the_sequential_pipeline_bit_for_bit():
    assert _uses_batch_workers(eh.images(True))
    for epoch in (0, 1):
        assert _plain(eh.images(True), epoch) == _plain(eh.images(None), epoch)
    for drop in (False, True):
        got = _plain(eh.images(True, batch=7, drop=drop))
        assert got == _plain(eh.images(None, batch=7, drop=drop))
        assert len(got) == (5 if drop else 6)
    assert _no_workers_left()


@pytest.mark.timeout(60)
def test_elements_made_after_the_fork_travel_through_shared_memory():
    def make(p):
        return (D.range(30).map(eh.fresh_tensor)
                .map(eh.combine, num_parallel_calls=2 if p else None, use_processes=p,
                     with_rng=True, seed=4)
                .batch(7))
    assert _uses_batch_workers(make(True))
    assert _plain(make(True)) == _plain(make(None))


def sharded(p):
    return auto_shard(eh.images(p, batch=3), 3, 1)  # DATA policy: shard(3, 1) before batch


def shard_between_maps(p):
    return (D.from_tensor_slices((eh.IMAGES, torch.arange(40)))
            .map(eh.augment, num_parallel_calls=2 if p else None, use_processes=p,
                 with_rng=True, seed=1)
            .shard(2, 1).map(eh.jitter, with_rng=True, seed=2).batch(4))


def fails_where_dropped(p):
    return (D.range(20).map(functools.partial(helpers.fail_on, 3), num_parallel_calls=2
                            if p else None, use_processes=p).shard(2, 0).batch(2))


@pytest.mark.timeout(60)
def test_sharded_batches_stay_in_the_workers():
    assert _uses_batch_workers(sharded(True)) and _uses_batch_workers(shard_between_maps(True))
    assert _plain(sharded(True)) == _plain(sharded(None))
    assert len(_plain(sharded(True))) == 5  # 13 of 40 elements kept, batches of 3
    assert _plain(shard_between_maps(True)) == _plain(shard_between_maps(None))
    assert_resumes_exactly(functools.partial(shard_between_maps, True), ks=[0, 2, 4])
    # an element the shard drops is still computed (and fails), as in the sequential pipeline
    for p in (None, True):
        with pytest.raises(MapFunctionError, match="element 3 of map"):
            list(fails_where_dropped(p))


@pytest.mark.timeout(60)
def test_padded_batch_and_plain_python_elements():
    def make(p):
        return D.range(23).map(eh.ragged, num_parallel_calls=2 if p else None,
                               use_processes=p).padded_batch(4, padding_values=np.int32(-1))
    assert _uses_batch_workers(make(True))
    assert _plain(make(True)) == _plain(make(None))
    ints = D.range(10).map(eh.py_work, num_parallel_calls=2, use_processes=True).batch(3)
    assert [b.tolist() for b in ints] == [
        [eh.py_work(i) for i in range(j, min(j + 3, 10))] for j in range(0, 10, 3)
    ]


@pytest.mark.timeout(90)
def test_resumes_exactly_between_and_inside_batches():
    assert_resumes_exactly(eh.images_processes, ks=[0, 2, 4])
    assert_resumes_exactly(eh.images_unbatched, ks=[3, 13, 39])  # mid-batch: batch of 6
    assert_resumes_exactly(eh.images_processes, ks=[3], fresh_process=True)


@pytest.mark.timeout(60)
def test_state_moves_between_threads_and_processes():
    for a, b in [(False, True), (True, False)]:
        with eh.images(a).iterator(epoch=0, seed=5) as it:
            head = [to_plain(x) for x in itertools.islice(it, 2)]
            state = json.loads(json.dumps(it.state_dict()))
        with eh.images(b).iterator_from_state(state) as it:
            rest = [to_plain(x) for x in it]
        assert head + rest == _plain(eh.images(None))


@pytest.mark.timeout(60)
def test_nondeterministic_batches_lose_and_repeat_nothing():
    def make():
        return (D.range(60).map(eh.slow_square, num_parallel_calls=2, use_processes=True,
                                deterministic=False).batch(4))
    with make().iterator(epoch=0, seed=1) as it:
        head = [b for b in itertools.islice(it, 6)]
        state = json.loads(json.dumps(it.state_dict()))
    with make().iterator_from_state(state) as it:
        rest = list(it)
    values = sorted(int(v) for b in head + rest for v in b[:, 0])
    assert values == [i * i for i in range(60)]
    assert all(len(b) == 4 for b in head + rest)


@pytest.mark.timeout(60)
def test_element_error_in_a_worker_names_the_stage_and_position():
    ds = (D.from_tensor_slices((eh.IMAGES, torch.arange(40)))
          .map(functools.partial(eh.fail_at, 21), num_parallel_calls=2, use_processes=True)
          .batch(8))
    got = []
    match = r"element 21 of map\(functools.partial\(<function fail_at"
    with pytest.raises(MapFunctionError, match=match) as info:
        for b in ds:
            got.append(b)
    assert len(got) == 2  # batches 0 and 1 come first, as in the sequential pipeline
    assert isinstance(info.value.__cause__, KeyError)
    assert "fail_at" in str(info.value.__cause__.__cause__)  # the worker's traceback
    assert not multiprocessing.active_children()

    bad_step = (D.range(10).map(eh.sleepy, num_parallel_calls=2, use_processes=True)
                .map(functools.partial(helpers.fail_on, 6)).batch(4))
    with pytest.raises(MapFunctionError, match=r"element 6 of map\(functools.partial\(<function fail_on"):
        list(bad_step)
    shapes = D.range(1, 6).map(eh.ragged, num_parallel_calls=2, use_processes=True).batch(5)
    with pytest.raises(ValueError, match="padded_batch"):
        list(shapes)


@pytest.mark.timeout(60)
def test_a_killed_worker_is_an_error_naming_the_stage():
    ds = D.range(400).map(eh.slow_square, num_parallel_calls=2, use_processes=True).batch(8)
    it = iter(ds)
    next(it)
    victim = it._holder[0].workers[0].proc
    os.kill(victim.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(bw.WorkerDiedError, match=r"map\(slow_square\) -> batch\(8\).*SIGKILL"):
        for _ in it:
            pass
    assert time.monotonic() - start < 10  # promise: a dead worker is an error at once, not a wait
    assert not multiprocessing.active_children()


@pytest.mark.timeout(60)
def test_autotune_picks_processes_for_python_and_threads_for_gil_free(caplog):
    """The engine is measured on the first epoch's own elements (no separate probe): pure
    Python moves to processes during it, and the next epoch builds whole batches in them."""
    with caplog.at_level(logging.INFO, logger="stratagem.data"):
        # filter: an unknown cardinality, so moving to processes is always worth it
        held = (D.range(60).filter(lambda x: True)
                .map(eh.py_work, num_parallel_calls=AUTOTUNE).batch(8))
        assert not _uses_batch_workers(held)  # not measured yet: starts sequential
        assert [int(x) for b in held for x in b] == [eh.py_work(i) for i in range(60)]
        assert _uses_batch_workers(held)
        assert [int(x) for b in held for x in b] == [eh.py_work(i) for i in range(60)]
        free = D.range(40).map(eh.sleepy, num_parallel_calls=AUTOTUNE).batch(8)
        assert [int(x) for b in free for x in b] == list(range(40))
        assert not _uses_batch_workers(free)
    lines = [r.getMessage() for r in caplog.records if "AUTOTUNE" in r.getMessage()]
    assert len(lines) == 2, lines  # once per map, not per iterator
    assert "map(py_work): AUTOTUNE runs it on processes" in lines[0]
    assert "map(sleepy): AUTOTUNE runs it on threads" in lines[1]


@pytest.mark.timeout(60)
def test_dropped_batches_give_their_shared_memory_back_for_the_next_epoch():
    ds = eh.images(True, batch=4)
    first = _plain(ds)
    pool = bw.arena_pool(ds)
    pooled = list(pool.free)
    assert pooled, "the first epoch's arenas are kept for the next one"
    kept = next(iter(ds.iterator(epoch=0, seed=5)))  # held by the test: not reusable
    assert to_plain(kept) == first[0]
    assert _plain(ds) == first  # the next workers write into the inherited arenas
    assert _no_workers_left()


@pytest.mark.timeout(60)
def test_an_input_error_comes_after_the_batches_before_it():
    def make(p):
        return (D.range(30).map(functools.partial(helpers.fail_on, 10))
                .map(eh.py_work, num_parallel_calls=2 if p else None, use_processes=p)
                .batch(4))
    for p in (None, True):
        got = []
        with pytest.raises(MapFunctionError, match="element 10 of map"):
            for b in make(p):
                got.append(b.tolist())
        assert got == [[eh.py_work(i) for i in range(j, j + 4)] for j in (0, 4)]
