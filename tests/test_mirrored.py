"""MirroredStrategy on 2-4 gloo processes: parity with one process, reductions, input, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.testing import assert_matches_single_device, run_workers


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def make_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def per_example(logits, y):
    return nn.functional.cross_entropy(logits, y, reduction="none")


def global_batches(sizes):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def parity_worker(n: int) -> str:
    strategy = sg.MirroredStrategy(num_replicas=n)
    # 3 steps: two full global batches of 8, then a partial batch of 3 (on 4 replicas one is empty)
    assert_matches_single_device(strategy, make_model, make_sgd, per_example, global_batches([8, 8, 3]))
    return "ok"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 4])
def test_parity_with_single_device(n):
    assert [r.value for r in run_workers(parity_worker, n, args=(n,))] == ["ok"] * n
