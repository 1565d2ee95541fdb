"""A training job that one rank breaks on purpose, for tests/faults/test_blame.py.

    python blame_job.py mirrored FAULT TARGET               (starts its second replica itself)
    python -m stratagem run -n 2 blame_job.py multiworker|sharded FAULT TARGET
    python -m stratagem run -n 3 blame_job.py pipeline FAULT TARGET

FAULT is ``raise`` (the program raises between steps), ``raise-in-step`` (inside the step: a
layer's forward), ``kill`` (SIGKILL to itself) or ``stop`` (SIGSTOP to itself); TARGET is the
rank (pipeline: the stage) that does it, after 20 steps, printing ``FAULT`` first.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn

import stratagem as sg
from stratagem.distribute.strategies.pipeline import PipelineStrategy

kind, fault, target = sys.argv[1], sys.argv[2], int(sys.argv[3])


class Breaks(nn.Module):
    """Passes its input through until told to break (``raise-in-step``)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x):
        if self.armed:
            raise ValueError("broken on purpose in the forward")
        return x


breaks = Breaks()
if kind == "mirrored":
    strategy = sg.MirroredStrategy(["cpu", "cpu"])
elif kind == "multiworker":
    strategy = sg.MultiWorkerMirroredStrategy()
elif kind == "sharded":
    strategy = sg.ShardedStrategy()
elif kind == "pipeline":
    strategy = PipelineStrategy(3, 6, schedule="interleaved_1f1b", balance=[1] * 6, devices="cpu")
else:
    raise SystemExit(f"unknown kind {kind!r}")

torch.manual_seed(0)
if kind == "pipeline":
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16),
                               nn.Linear(16, 3)]
    # chunk c of the interleaved plan lives on stage c % 3: put the breaking layer on TARGET
    layers.insert(target, breaks)
    with strategy.scope():
        pipe = strategy.pipeline(nn.Sequential(*layers), nn.CrossEntropyLoss(), verbose=False)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    rank = strategy.stage

    def train_step(x, y):
        loss = strategy.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()
        return loss
else:
    with strategy.scope():
        model = nn.Sequential(nn.Linear(8, 16), breaks, nn.Tanh(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = strategy.extended.replica_id

    def step(x, y):
        opt.zero_grad()
        loss = sg.compute_average_loss(nn.functional.cross_entropy(model(x), y, reduction="none"),
                                       global_batch_size=24)
        loss.backward()
        opt.step()
        return loss

    def train_step(x, y):
        return strategy.run(step, args=(x, y))

g = torch.Generator().manual_seed(1)
x, y = torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g)
if kind != "pipeline":
    n = strategy.num_replicas_in_sync
    x, y = x.chunk(n)[rank], y.chunk(n)[rank]
for i in range(100000):
    if i == 20 and rank == target:
        print(f"FAULT {fault} by rank {rank}", flush=True)
        if fault == "raise":
            raise ValueError("broken on purpose between steps")
        if fault == "raise-in-step":
            breaks.armed = True
        elif fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
    train_step(x, y)
    time.sleep(0.01)
