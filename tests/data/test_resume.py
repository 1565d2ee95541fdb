"""Exact resume: take k, save (through JSON), restore, compare with an uninterrupted run."""

import json
import os

import helpers
import pytest
import torch

from stratagem.data import AUTOTUNE, Dataset, assert_resumes_exactly

D = Dataset
KS = [0, 1, 3, 7, 12]

PIPELINES = {
    "range": lambda: D.range(15),
    "slices dict": lambda: D.from_tensor_slices({"a": list(range(10)), "b": [[i, i] for i in range(10)]}),
    "generator": lambda: D.from_generator(lambda: iter(range(9))),
    "map rng": lambda: D.range(15).map(helpers.noisy, with_rng=True),
    "parallel map": lambda: D.range(15).map(helpers.square_array, num_parallel_calls=3),
    "parallel map nondeterministic": lambda: D.range(15).map(
        helpers.square_array, num_parallel_calls=3, deterministic=False
    ),
    "filter": lambda: D.range(30).filter(lambda x: x % 3 == 0),
    "flat_map": lambda: D.range(6).flat_map(lambda x: D.range(x)),
    "interleave": lambda: D.range(1, 6).interleave(
        lambda x: D.from_tensors(x).repeat(x), cycle_length=2, block_length=2
    ),
    "interleave parallel": lambda: D.range(1, 7).interleave(
        lambda x: D.range(x).map(lambda y: y * 10 + x), cycle_length=3, block_length=2,
        num_parallel_calls=AUTOTUNE,
    ),
    "batch": lambda: D.range(20).batch(3),
    "padded_batch": lambda: D.range(1, 9).map(lambda x: torch.ones(x)).padded_batch(3),
    "unbatch": lambda: D.range(20).batch(3).unbatch(),
    "shuffle": lambda: D.range(30).shuffle(7),
    "shuffle seeded repeat": lambda: D.range(10).shuffle(4, seed=1).repeat(3),
    "repeat take skip": lambda: D.range(5).repeat(4).skip(3).take(14),
    "shard": lambda: D.range(40).shard(3, 1),
    "enumerate zip concatenate": lambda: D.zip(D.range(8), D.range(8).enumerate()).concatenate(
        D.zip(D.range(5), D.range(5).enumerate())
    ),
    "cache memory": lambda: D.range(10).cache().repeat(2),
    "prefetch": lambda: D.range(20).map(lambda x: x + 1, num_parallel_calls=2).prefetch(3),
    "list_files": lambda: D.list_files(os.path.join(os.path.dirname(__file__), "*.py")),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(PIPELINES))
def test_resumes_exactly(name):
    # deterministic=False may reorder: the contract is every element once, none lost
    assert_resumes_exactly(PIPELINES[name], KS, ordered="nondeterministic" not in name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("parallel", [None, 1, 3])
def test_representative_pipeline_every_step(tmp_path, parallel):
    helpers.write_text_files(str(tmp_path), n_files=4, lines=7)
    ref = assert_resumes_exactly(
        lambda: helpers.representative(str(tmp_path), parallel), ks=range(0, 8)
    )
    assert len(ref) == 7  # 28 lines in batches of 4


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_representative_pipeline_fresh_process(tmp_path, monkeypatch):
    helpers.write_text_files(str(tmp_path), n_files=4, lines=7)
    monkeypatch.setenv("STRATAGEM_TEST_FILES", str(tmp_path))
    monkeypatch.setattr(helpers, "FILES_DIR", str(tmp_path))
    assert_resumes_exactly(helpers.make_representative, ks=[0, 2, 5], fresh_process=True)


@pytest.mark.timeout(30)
def test_state_is_json_and_epoch_reshuffles():
    ds = D.range(10).shuffle(10)
    it = iter(ds)
    next(it)
    state = it.state_dict()
    assert json.loads(json.dumps(state)) == state
    it.close()
    a, b = list(ds), list(ds)
    assert sorted(a) == sorted(b) and a != b


@pytest.mark.timeout(30)
def test_exhausted_iterator_state_resumes_to_nothing():
    ds = D.range(4).map(lambda x: x, num_parallel_calls=2)
    it = iter(ds)
    assert list(it) == [0, 1, 2, 3]
    assert list(ds.iterator_from_state(it.state_dict())) == []


@pytest.mark.timeout(30)
def test_wrong_state_is_a_clear_error():
    with pytest.raises(ValueError, match="state_dict"):
        iter(D.range(3)).load_state_dict({"foo": 1})
