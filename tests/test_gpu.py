"""CUDA paths (NCCL, device placement); skipped cleanly on machines without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.testing import run_workers
from tests_gpu_workers import nccl_parity_worker  # noqa: F401  (importable by the workers)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]


def test_one_device_strategy_places_the_model_on_the_gpu():
    s = sg.OneDeviceStrategy("cuda:0")
    with s.scope():
        model = nn.Linear(4, 2)
    assert model.weight.device.type == "cuda"
    out = s.run(lambda x: model(x), args=(torch.ones(3, 4),))
    assert out.device.type == "cuda"


@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL replicas need 2 GPUs")
def test_mirrored_over_nccl_matches_single_device():
    assert [r.value for r in run_workers(nccl_parity_worker, 2, timeout=220)] == ["ok", "ok"]
