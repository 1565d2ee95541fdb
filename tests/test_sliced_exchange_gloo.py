"""The deterministic mode's sliced exchange (``comm/blocks.py``) over torch.distributed: gloo's
all-to-all with uneven parts and its all-gather give every replica one process's root of the
tree, bit for bit, after backward and overlapped with it (NCCL when two GPUs are here)."""

from __future__ import annotations

import pytest
import torch

from sliced_workers import sliced_roots
from stratagem.testing import run_workers


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "n"), [(2, 5), (3, 7), (4, 4)])
def test_gloo_replicas_end_with_one_process_root(world, n):
    for r in run_workers(sliced_roots, world, args=(n,), timeout=100):
        v = r.value
        assert v["sliced"] == v["one"]
        assert v["overlapped"] == v["one_model"]
        assert int(v["buckets"]) >= 2


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between processes needs two CUDA devices")
def test_nccl_replicas_end_with_one_process_root():
    for r in run_workers(sliced_roots, 2, args=(5, "nccl"), timeout=150):
        assert r.value["sliced"] == r.value["one"]
        assert r.value["overlapped"] == r.value["one_model"]
