"""map(use_processes=True): chunked tasks keep order, resume, seeds and error positions."""

import functools
import gc
import itertools
import json
import multiprocessing

import helpers
import numpy as np
import pytest

import stratagem.data.parallel as parallel
from stratagem.data import AUTOTUNE, Dataset, MapFunctionError, assert_resumes_exactly

D = Dataset


@pytest.fixture
def chunk_sizes(monkeypatch):
    sizes = []
    submit = parallel._ParallelMapIterator._submit

    def spy(self, batch):
        if self.ds._use_processes:
            sizes.append(len(batch))
        return submit(self, batch)

    monkeypatch.setattr(parallel._ParallelMapIterator, "_submit", spy)
    return sizes


@pytest.mark.timeout(60)
def test_chunks_keep_order_and_error_position(chunk_sizes):
    ds = D.range(400).map(functools.partial(helpers.fail_on, 330), num_parallel_calls=2,
                          use_processes=True)
    got = []
    with pytest.raises(MapFunctionError, match="element 330 of map") as info:
        for x in ds:
            got.append(x)
    assert got == list(range(330))
    assert max(chunk_sizes) > 1, "fast elements travel in chunks"
    assert isinstance(info.value.__cause__, KeyError)
    assert "fail_on" in str(info.value.__cause__.__cause__)  # the worker's traceback
    assert not multiprocessing.active_children()


@pytest.mark.timeout(60)
def test_nested_arrays_in_and_out_and_autotune(chunk_sizes):
    ds = D.from_tensor_slices({"a": np.arange(300 * 2).reshape(300, 2), "b": (list(range(300)),
                               [f"s{i}" for i in range(300)])})
    out = list(ds.map(helpers.double_leaves, num_parallel_calls=AUTOTUNE, use_processes=True))
    assert len(out) == 300
    for i, e in enumerate(out):
        np.testing.assert_array_equal(e["a"], np.array([4 * i, 4 * i + 2]))
        assert e["b"][0] == i + 1 and e["b"][1] == f"s{i}"
    assert max(chunk_sizes) > 1


@pytest.mark.timeout(90)
def test_resumes_exactly_with_seeds():
    def make():
        return D.range(150).map(helpers.noisy, num_parallel_calls=2, with_rng=True, seed=5,
                                use_processes=True)

    ref = assert_resumes_exactly(make, ks=[0, 7, 120])
    threads = D.range(150).map(helpers.noisy, num_parallel_calls=3, with_rng=True, seed=5)
    assert [r["values"] for r in ref] == [
        t.tolist() for t in threads.iterator(epoch=0, seed=1234)
    ]


@pytest.mark.timeout(60)
def test_nondeterministic_resume_loses_and_repeats_nothing():
    ds = D.range(200).map(helpers.square_array, num_parallel_calls=2, use_processes=True,
                          deterministic=False)
    with ds.iterator(epoch=0, seed=1) as it:
        head = [int(x[0]) for x in itertools.islice(it, 90)]
        state = json.loads(json.dumps(it.state_dict()))
    with ds.iterator_from_state(state) as it:
        rest = [int(x[0]) for x in it]
    assert sorted(head + rest) == [i * i for i in range(200)]


@pytest.mark.timeout(60)
def test_unpicklable_worker_exception_still_names_the_element():
    ds = D.range(10).map(helpers.raise_unpicklable, num_parallel_calls=2, use_processes=True)
    with pytest.raises(MapFunctionError, match=r"element 3 of map.*UnpicklableError"):
        list(ds)
    assert not multiprocessing.active_children()


@pytest.mark.timeout(60)
def test_workers_stop_with_each_iterator_across_epochs():
    ds = D.range(20).map(helpers.square_array, num_parallel_calls=2, use_processes=True)
    for epoch in range(3):
        it = ds.iterator(epoch=epoch)
        assert int(next(it)[0]) == 0
        assert multiprocessing.active_children()
        it.close()
        assert not multiprocessing.active_children()


@pytest.mark.timeout(60)
def test_dropped_process_iterator_is_collected():
    it = iter(D.range(50).map(helpers.square_array, num_parallel_calls=2, use_processes=True))
    next(it)
    assert multiprocessing.active_children()
    del it
    gc.collect()
    assert not multiprocessing.active_children()


@pytest.mark.timeout(60)
def test_results_of_every_kind_come_back_as_they_were_made():
    """Small tensors are copied through the pipe, large arrays and tensors go through shared
    memory: either way each element is the one the same map gives in this process (type, dtype,
    shape, values)."""
    import torch

    out = list(D.range(6).map(helpers.leaves_of_every_kind, num_parallel_calls=2, use_processes=True))
    here = list(D.range(6).map(helpers.leaves_of_every_kind))
    assert len(out) == len(here) == 6
    for e, want in zip(out, here):
        for key, value in want.items():
            got = e[key]
            assert type(got) is type(value), (key, type(got))
            assert got.dtype == value.dtype and tuple(got.shape) == tuple(value.shape), key
            if isinstance(value, torch.Tensor):
                assert torch.equal(got, value), key
            else:
                np.testing.assert_array_equal(got, value)
