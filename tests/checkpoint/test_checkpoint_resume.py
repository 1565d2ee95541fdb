"""Exact resume: n steps uninterrupted == k steps, kill every process, restart, finish. Two
replicas, a shuffled pipeline with a parallel map, dropout (per-rank RNG), Adam."""

from __future__ import annotations

import pytest
import torch
from ckpt_workers import resume_worker

from stratagem.testing import run_workers

TOTAL, STOP = 12, 5


def _same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.timeout(240)
def test_killed_and_resumed_run_is_bit_identical(tmp_path):
    full = run_workers(resume_worker, 2, args=(str(tmp_path / "full"), TOTAL, None), timeout=120)
    killed = run_workers(resume_worker, 2, args=(str(tmp_path / "job"), TOTAL, STOP), timeout=120, check=False)
    assert [r.returncode for r in killed] == [-9, -9], [r.stderr[-1500:] for r in killed]
    resumed = run_workers(resume_worker, 2, args=(str(tmp_path / "job"), TOTAL, None), timeout=120)
    for rank in range(2):
        want, got = full[rank].value, resumed[rank].value
        assert got["restored"].endswith(f"ckpt-{STOP}")
        assert got["start"] == STOP
        assert got["seen"] == want["seen"][STOP:], f"rank {rank}: data order differs after resume"
        _same(want["params"], got["params"], f"rank {rank} params")
        _same(want["opt"], got["opt"], f"rank {rank} optimizer")
    # the two replicas read different shards but hold the same parameters
    assert full[0].value["seen"] != full[1].value["seen"]
    _same(full[0].value["params"], full[1].value["params"])
