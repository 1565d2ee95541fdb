"""A training script for `stratagem run` tests: MultiWorkerMirroredStrategy, prints a digest."""

from __future__ import annotations

import hashlib
import sys

import torch
from torch import nn

from stratagem.cluster.resolvers import detect
from stratagem.distribute.bootstrap import connect_to_cluster, initialize_system
from stratagem.distribute.strategies.multi_worker import MultiWorkerMirroredStrategy


def main() -> None:
    fail = sys.argv[1] if len(sys.argv) > 1 else ""
    resolver = detect()
    connect_to_cluster(resolver, device="cpu")
    initialize_system(resolver, config={"script": "mw_script"}, device="cpu")
    strategy = MultiWorkerMirroredStrategy(resolver, devices="cpu")
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(5)]
    rank = strategy.extended.replica_id
    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches)):
        if fail == "raise" and rank == 1 and i == 2:
            raise ValueError("failing on purpose")

        def step(x, y):
            opt.zero_grad()
            ((model(x) - y) ** 2).sum().div(8).backward()
            opt.step()

        strategy.run(step, args=(x, y))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    spec = resolver.cluster_spec()
    print(f"rank={rank} world={spec.world_size} worker={spec.task_index} digest={digest}", flush=True)


if __name__ == "__main__":
    main()
