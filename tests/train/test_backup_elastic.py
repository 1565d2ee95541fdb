"""BackupAndRestore into another number of replicas: a run killed mid-epoch on 2 replicas
resumes on 3, one killed on 3 resumes on one process, one process's on 2 replicas; each ends
where an uninterrupted single-device run ends (parameters, and the History with its mid-epoch
metric totals)."""

from __future__ import annotations

import pytest
import torch
from fit_workers import elastic_backup_run

from stratagem.testing import run_workers


def _close(got: dict, want: dict) -> None:
    for k in want["params"]:
        torch.testing.assert_close(got["params"][k], want["params"][k], rtol=1e-5, atol=1e-6, msg=k)
    assert got["history"].keys() == want["history"].keys()
    for k in want["history"]:
        assert got["history"][k] == pytest.approx(want["history"][k], rel=1e-5), k


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("split", [True, False], ids=["each-replica-reads-its-share", "replicas-split-global-batches"])
def test_a_backup_resumes_on_another_number_of_replicas(tmp_path, split):
    want = elastic_backup_run(1, str(tmp_path / "reference"), None, split)
    assert want["restored_from"] is None
    # (killed on, after step, resumed on): mid-epoch 2 on 2 -> 3 replicas, mid-epoch 3 on 3 -> one
    # process, and one process -> 2 replicas (its pipeline had no per-replica split at all)
    for before, step, after in ((2, 8, 3), (3, 14, 1), (1, 8, 2)):
        backup = str(tmp_path / f"{before}-then-{after}")
        killed = run_workers(elastic_backup_run, before, args=(before, backup, step, split), timeout=120, check=False)
        assert all(r.returncode == -9 for r in killed), [r.stderr[-500:] for r in killed]
        for r in run_workers(elastic_backup_run, after, args=(after, backup, None, split), timeout=120,
                             allow_stderr=[("keep their own 'rng'", "more replicas than saved RNG streams: said once")]):
            assert r.value["restored_from"].endswith(f"ckpt-{step}"), (before, after)
            _close(r.value, want)


def _record(data: dict, totals: list[float], epoch: int = 1) -> dict:
    import json

    from stratagem.train.resume import FORMAT

    return {"json": json.dumps({
        "format": FORMAT, "epoch": epoch, "step": 2, "iterations": 8, "history": {}, "loss_scale": None,
        "data": {"pass": 1, "consumed": 2, "epoch_step": 2, "exhausted": False, **data},
        "metrics": [["loss", totals]],
    })}  # fmt: skip


def test_fit_progress_maps_to_another_number_of_replicas_or_says_why_not():
    import json

    from stratagem.train.resume import FitProgress

    split = {"replayable": True, "iterator": {"source": {"seed": "123", "root": "this replica's pipeline"}}}
    saved = [_record(split, [3.0, 2.0]), _record(split, [5.0, 4.0])]
    new = [json.loads(FitProgress.reshard_state(saved, r, 3)["json"]) for r in range(3)]
    assert [n["metrics"] for n in new] == [[["loss", [8.0, 6.0]]], [["loss", [0.0, 0.0]]], [["loss", [0.0, 0.0]]]]
    for n in new:  # the pass is replayed with its seed; no pipeline state is carried over
        assert "iterator" not in n["data"] and n["data"]["consumed"] == 2 and n["data"]["seed"] == 123
        assert (n["epoch"], n["step"], n["iterations"]) == (1, 2, 8)

    by_files = {"replayable": False}
    with pytest.raises(ValueError, match="reading its own files or pipeline .* cannot resume on 3. Resume with 2"):
        FitProgress.reshard_state([_record(by_files, [1.0])] * 2, 0, 3)
    with pytest.raises(ValueError, match="disagree on 'epoch'"):
        FitProgress.reshard_state([_record(split, [1.0]), _record(split, [1.0], epoch=2)], 0, 3)
