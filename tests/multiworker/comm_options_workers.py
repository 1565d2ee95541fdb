"""Functions the CommunicationOptions tests run as separate processes (module level, importable)."""

from __future__ import annotations

import torch
from torch import nn

from stratagem.cluster.resolvers import TorchrunClusterResolver
from stratagem.distribute.bootstrap import CommunicationImplementation, CommunicationOptions
from stratagem.distribute.strategies.multi_worker import MultiWorkerMirroredStrategy


def bucket_plan(bytes_per_pack: int) -> list[tuple[int, ...]]:
    """The gradient reducer's bucket plan after two steps (the order is learnt in the first)."""
    options = CommunicationOptions(
        bytes_per_pack=bytes_per_pack, timeout_seconds=30, implementation=CommunicationImplementation.RING
    )
    strategy = MultiWorkerMirroredStrategy(TorchrunClusterResolver(), options)
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    for _ in range(2):
        strategy.run(step, args=(torch.randn(4, 64),))
    reducer = strategy.extended.registry.reducer
    assert strategy.device == torch.device("cpu"), strategy.device
    return [b.params for b in reducer.buckets]
