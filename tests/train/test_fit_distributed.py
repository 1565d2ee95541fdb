"""fit on 2 replicas: parity with one device, exact metrics, stopping together, output once, resume."""

from __future__ import annotations

import pytest
import torch
from fit_workers import backup_worker, parity_worker
from torch.nn import functional as F

from stratagem.testing import run_workers


def _same(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    results = run_workers(parity_worker, 2, args=(str(tmp_path_factory.mktemp("ref-backup")),), timeout=150)
    return results


@pytest.mark.timeout(180)
def test_mirrored_fit_matches_one_device(two_replicas):
    r0, r1 = (r.value for r in two_replicas)
    for r in (r0, r1):
        _same(r["mirrored"]["params"], r["one"]["params"])
        hm, ho = r["mirrored"]["history"], r["one"]["history"]
        assert hm.keys() == ho.keys() == {
            "loss", "sparse_categorical_accuracy", "top_k_categorical_accuracy",
            "val_loss", "val_sparse_categorical_accuracy", "val_top_k_categorical_accuracy",
        }
        for k in hm:
            assert hm[k] == pytest.approx(ho[k], rel=1e-5), k
        _same(r["dataset"], r["ref3"])
        _same(r["dataloader"], r["ref3"])
    _same(r0["mirrored"]["params"], r1["mirrored"]["params"], rtol=0, atol=0)  # replicas identical
    assert r0["mirrored"]["history"] == r1["mirrored"]["history"]  # logs are global: bit-identical


@pytest.mark.timeout(180)
def test_metrics_are_exact_with_partial_and_empty_batches(two_replicas):
    r0, r1 = (r.value for r in two_replicas)
    assert r0["acc_in_run"] == r1["acc_in_run"] == r0["acc_synced"] == r1["acc_synced"] == 3 / 4
    # evaluate/predict under Mirrored with a global batch of 1 (replica 1 empty) vs plain torch
    from fit_workers import global_batches

    data = global_batches([8, 8, 5, 1])
    y = torch.cat([b[1] for b in data])
    for r in (r0, r1):
        out = r["predict"]
        assert out.shape == (22, 3)
        assert r["evaluate"]["sparse_categorical_accuracy"] == (out.argmax(1) == y).sum().item() / 22
        assert r["evaluate"]["loss"] == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-6)
    torch.testing.assert_close(r0["predict"], r1["predict"], rtol=0, atol=0)


@pytest.mark.timeout(180)
def test_early_stopping_stops_every_replica_at_the_same_epoch(two_replicas):
    r0, r1 = (r.value for r in two_replicas)
    assert r0["early_epochs"] == r1["early_epochs"] == [0, 1]
    assert r0["asked_epochs"] == r1["asked_epochs"] == [0, 1, 2]


@pytest.mark.timeout(180)
def test_progress_printed_once_by_replica_0(two_replicas):
    out0, out1 = two_replicas[0].stdout, two_replicas[1].stdout
    assert "replica 0 starts" in out0 and "replica 1 starts" in out1  # both stdouts were captured
    epochs0 = [line for line in out0.splitlines() if line.startswith("Epoch ")]
    assert [line.split(" - ")[0] for line in epochs0] == ["Epoch 1/2", "Epoch 2/2"]
    assert all("val_loss: " in line and "samples/s" in line for line in epochs0)
    assert "Epoch" not in out1


@pytest.mark.timeout(240)
def test_backup_and_restore_resumes_exactly_after_sigkill(two_replicas, tmp_path):
    ref = two_replicas[0].value["backup_ref"]
    backup = str(tmp_path / "backup")
    killed = run_workers(backup_worker, 2, args=(backup, 7), timeout=90, check=False)
    assert [r.returncode for r in killed] == [-9, -9], [r.stderr[-2000:] for r in killed]
    resumed = run_workers(backup_worker, 2, args=(backup, None), timeout=90)
    for r in resumed:
        got = r.value
        assert got["restored_from"] is not None and got["restored_from"].endswith("ckpt-6")
        _same(got["params"], ref["params"], rtol=0, atol=0)
        assert got["history"] == ref["history"]
        assert got["left"] == []  # backups are deleted when training ends normally
    assert ref["restored_from"] is None


@pytest.mark.timeout(180)
def test_pipeline_fit_matches_one_device():
    from fit_workers import global_batches, pipeline_worker

    results = run_workers(pipeline_worker, 2, timeout=150)
    stages = {r.value["stage"]: r for r in results}
    assert sorted(stages) == [0, 1]
    names = set()
    for r in results:
        v = r.value
        ref = v["ref"]
        for usage in ("scope", "pipe", "resumed"):
            got = v[usage]
            assert got["params"], usage
            for name, p in got["params"].items():
                torch.testing.assert_close(p, ref["params"][name], rtol=1e-5, atol=4e-5, msg=f"{usage} {name}")
                names.add(name)
            assert got["history"].keys() == ref["history"].keys()
            for k in ref["history"]:
                assert got["history"][k] == pytest.approx(ref["history"][k], rel=1e-5), (usage, k)
        assert v["predict"].shape == (21, 3)
        y = torch.cat([b[1] for b in global_batches([8, 8, 5])])
        assert v["evaluate"]["loss"] == pytest.approx(F.cross_entropy(v["predict"], y).item(), rel=1e-6)
    assert names == {n for n in results[0].value["ref"]["params"]}  # the stages cover the model
    torch.testing.assert_close(stages[0].value["predict"], stages[1].value["predict"], rtol=0, atol=0)
    # only stage 0 prints
    assert "stage 1 starts" in stages[1].stdout and "Epoch" not in stages[1].stdout
    assert [ln.split(" - ")[0] for ln in stages[0].stdout.splitlines() if ln.startswith("Epoch")] == ["Epoch 1/2", "Epoch 2/2"]


@pytest.mark.timeout(180)
def test_multi_worker_fit_matches_one_device():
    from fit_workers import multi_worker_worker

    for r in run_workers(multi_worker_worker, 2, timeout=150):
        v = r.value
        for got, ref in (("list", "ref_list"), ("dataset", "ref_dataset")):
            _same(v[got][0], v[ref][0])
            for k in v[ref][1]:
                assert v[got][1][k] == pytest.approx(v[ref][1][k], rel=1e-5), (got, k)
