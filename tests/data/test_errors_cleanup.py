"""Errors name the element and shut the pipeline down; no thread or process is left behind."""

import gc
import multiprocessing
import threading
import time

import helpers
import pytest
import torch

from stratagem.data import AUTOTUNE, Dataset, MapFunctionError, procs

D = Dataset


def _threads():
    return {t for t in threading.enumerate() if t.name.startswith("stratagem")}


def _wait_clean(before, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not (_threads() - before) and not multiprocessing.active_children():
            return True
        gc.collect()
        time.sleep(0.05)
    return False


def busy_pipeline():
    return (
        D.range(1, 9)
        .interleave(lambda x: D.range(100).map(lambda y: y + x), cycle_length=3,
                    num_parallel_calls=AUTOTUNE)
        .map(lambda x: torch.full((4,), x), num_parallel_calls=AUTOTUNE)
        .shuffle(16)
        .batch(4)
        .prefetch(AUTOTUNE)
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("parallel", [None, 2])
def test_map_error_names_position(parallel):
    ds = D.range(10).map(helpers.fail_on_5, num_parallel_calls=parallel).prefetch(2)
    before = _threads()
    got = []
    with pytest.raises(MapFunctionError, match="element 5 of map") as info:
        for x in ds:
            got.append(x)
    assert got == [0, 1, 2, 3, 4]
    assert isinstance(info.value.__cause__, KeyError)
    assert isinstance(info.value, ValueError)
    assert _wait_clean(before)


@pytest.mark.timeout(30)
def test_batch_of_mismatched_shapes_suggests_padded_batch():
    ds = D.range(1, 4).map(lambda x: torch.zeros(x)).batch(3)
    with pytest.raises(ValueError, match=r"\(1,\).*\(2,\).*padded_batch"):
        list(ds)


@pytest.mark.timeout(30)
def test_close_stops_threads():
    before = _threads()
    it = iter(busy_pipeline())
    for _ in range(3):
        next(it)
    assert _threads() - before, "the pipeline runs background threads"
    it.close()
    assert _wait_clean(before)


@pytest.mark.timeout(30)
def test_dropped_iterator_is_collected():
    before = _threads()
    it = iter(busy_pipeline())
    next(it)
    del it
    gc.collect()
    assert _wait_clean(before)


@pytest.mark.timeout(30)
def test_exhausted_iterator_stops_threads():
    before = _threads()
    assert len(list(busy_pipeline())) == 200
    assert _wait_clean(before)


@pytest.mark.timeout(60)
def test_process_pool_map_and_cleanup():
    before = _threads()
    ds = D.range(12).map(helpers.square_array, num_parallel_calls=2, use_processes=True)
    it = iter(ds)
    out = [x.tolist() for x in it]
    assert out == [[i * i] * 3 for i in range(12)]
    assert _wait_clean(before, timeout=20)


@pytest.mark.timeout(60)
def test_process_pool_error_and_unpicklable():
    ds = D.range(10).map(helpers.fail_on_5, num_parallel_calls=2, use_processes=True)
    with pytest.raises(MapFunctionError, match="element 5"):
        list(ds)
    assert _wait_clean(set(), timeout=20) or not multiprocessing.active_children()
    if procs.forks():  # forked workers inherit the function: a lambda works, as in DataLoader
        lam = D.range(3).map(lambda x: x + 1, num_parallel_calls=2, use_processes=True)
        assert list(lam) == [1, 2, 3]
    else:
        with pytest.raises(TypeError, match="picklable"):
            D.range(3).map(lambda x: x, num_parallel_calls=2, use_processes=True)


@pytest.mark.timeout(60)
def test_process_pool_rng_matches_threads():
    a = D.range(6).map(helpers.noisy, num_parallel_calls=2, with_rng=True, seed=9,
                       use_processes=True)
    b = D.range(6).map(helpers.noisy, with_rng=True, seed=9)
    assert [t.tolist() for t in a.iterator(epoch=0)] == [t.tolist() for t in b.iterator(epoch=0)]
