"""A torch DataLoader under MirroredStrategy(2): sharded per replica, seeded per job, resumable.

Each replica fetches only its share of every global batch (counted in the dataset's
``__getitem__``), an unseeded ``shuffle=True`` draws one order per epoch on every replica, and
the result is one process's on the same global batches."""

from __future__ import annotations

import pytest
import torch
from loader_workers import main_worker, more_worker

from stratagem.testing import run_workers


def _same(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


@pytest.fixture(scope="module")
def main():
    return [r.value for r in run_workers(main_worker, 2, timeout=150)]


@pytest.fixture(scope="module")
def more(tmp_path_factory):
    return [r.value for r in run_workers(more_worker, 2, args=(str(tmp_path_factory.mktemp("backup")),), timeout=200)]


@pytest.mark.timeout(180)
def test_fit_over_an_unseeded_loader_reads_half_on_each_replica_and_matches_one_process(main):
    r0, r1 = main
    for r in (r0, r1):
        u = r["unseeded"]
        assert u["counts"] == [100, 100]  # 200 examples a epoch: each replica fetched its half
        assert u["orders"] == r0["unseeded"]["orders"]
        for order in u["orders"]:  # every example once an epoch, in global batches of 64
            assert sorted(i for b in order for i in b) == list(range(200))
            assert [len(b) for b in order] == [64, 64, 64, 8]
        assert u["orders"][0] != u["orders"][1]  # epoch 2 reshuffled
        _same(u["params"], u["ref"])  # one process on the same global batches
    _same(r0["unseeded"]["params"], r1["unseeded"]["params"], rtol=0, atol=0)


@pytest.mark.timeout(180)
def test_a_seeded_generator_draws_the_batches_one_process_draws(main):
    for r in main:
        s = r["seeded"]
        assert s["counts"] == [100, 100]
        assert s["orders"] == s["one"]  # both epochs: one process's loader with the same generator
        assert s["orders"][0] != s["orders"][1]


@pytest.mark.timeout(180)
def test_evaluate_and_predict_over_a_loader_match_one_process(main):
    for r in main:
        # 129 examples: batches 64, 64, 1; the last leaves replica 1 a zero-size share
        assert r["evaluate"] == pytest.approx(r["evaluate_one"], rel=1e-6)
        assert r["predict"].shape == (129, 3)
        torch.testing.assert_close(r["predict"], r["predict_one"], rtol=1e-6, atol=1e-6)  # in order
        assert r["predict_count"] == 65  # 32 + 32 + 1 (the empty share fetches one example to shape it)


@pytest.mark.timeout(180)
def test_experimental_distribute_dataset_of_a_loader_in_a_custom_loop(main):
    r0, r1 = main
    for r in (r0, r1):
        c = r["custom"]
        assert c["counts"][0] + (r1 if r is r0 else r0)["custom"]["counts"][0] == 100  # batches of 15 = 8 + 7
        assert c["orders"][0] != c["orders"][1]
        for epoch in range(2):  # strategy.reduce of the replicas' shares: the global batch's sums
            want = [float(c["x"][b].sum()) for b in c["orders"][epoch]]
            assert c["sums"][epoch] == pytest.approx(want, abs=1e-4)
    assert r0["custom"]["counts"] == [53, 53] and r1["custom"]["counts"] == [47, 47]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["resume", "resume_seeded"])
def test_an_interrupted_fit_resumes_the_loader_exactly(more, kind):
    for r in more:
        d = r[kind]
        assert d["restored_from"] is not None and d["restored_from"].endswith("ckpt-6")
        _same(d["params"], d["full"], rtol=0, atol=0)
        assert d["history"] == d["full_history"]
        # after step 6 (epoch 2's second batch): epoch 2's last two shares, 32 + 4, then epoch 3's
        # 100; the skipped batches were not fetched again
        assert d["fetched"] == 136


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_iterable_dataset_loader_is_read_whole_and_split(more):
    for r in more:
        _same(r["iterable"]["params"], r["iterable"]["ref"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_replicas_drawing_different_batches_are_an_error_naming_the_sampler(more):
    for r in more:
        assert r["mismatch"] is not None
        assert r["mismatch"].startswith("ReplicaMismatchError: the DataLoader's first global batches differ")
        assert "seed the sampler alike on every replica" in r["mismatch"]
