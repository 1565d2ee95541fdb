"""Shared models, data and worker functions for the fit tests (importable by run_workers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import stratagem as sg
from stratagem.train import fit


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def global_batches(sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def build(strategy: Any, seed: int = 0, lr: float = 0.1) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    with strategy.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, opt


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def train(strategy: Any, data: Any, **kw: Any) -> tuple[nn.Module, Any]:
    model, opt = build(strategy)
    kw.setdefault("verbose", 0)
    history = fit(model, opt, nn.CrossEntropyLoss(), data, strategy=strategy, **kw)
    return model, history
