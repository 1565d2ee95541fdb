"""Worker functions for tests/test_gpu.py (run in fresh processes)."""

from __future__ import annotations

import torch
from torch import nn

import stratagem as sg
from stratagem.testing import assert_matches_single_device


def nccl_parity_worker() -> str:
    strategy = sg.MirroredStrategy(devices="cuda", num_replicas=2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (8, 8, 3)]
    assert_matches_single_device(
        strategy,
        lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)),
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda logits, y: nn.functional.cross_entropy(logits.cpu(), y.cpu(), reduction="none"),
        batches,
        atol=1e-5,
    )
    return "ok"
