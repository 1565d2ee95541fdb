"""A multi-worker job as docs/MULTIWORKER.md writes it (TF_CONFIG, the defaults), training a
Linear(WIDTH, WIDTH) for STEPS steps and printing a line per step, for the partition tests."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

import stratagem
from stratagem import cluster_resolver

width = int(os.environ.get("WIDTH", "256"))
steps = int(os.environ.get("STEPS", "100000"))
resolver = cluster_resolver.detect()
stratagem.connect_to_cluster(resolver)
strategy = stratagem.MultiWorkerMirroredStrategy(resolver)
with strategy.scope():
    model = nn.Linear(width, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
rank = strategy.extended.replica_id
x = torch.randn(8, width)


def step(x):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


start = time.monotonic()
for i in range(steps):
    strategy.run(step, args=(x,))
    print(f"rank {rank} step {i} t={time.monotonic() - start:.2f}", flush=True)
    time.sleep(0.02)
print(f"rank {rank} done", flush=True)
