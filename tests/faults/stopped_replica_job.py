"""MirroredStrategy on 2 replicas (the README's way); replica 1 stops itself with SIGSTOP at
step 50, as a user's `kill -STOP` would (tests/faults/test_stopped_replica.py)."""

import os
import signal
import time

import torch
from torch import nn

import stratagem as sg

strategy = sg.MirroredStrategy(["cpu", "cpu"])
with strategy.scope():
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
rank = strategy.extended.replica_id


def step(x):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


x = torch.randn(8, 16)
for i in range(400):
    if i == 50 and rank == 1:
        print(f"STOP {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    strategy.run(step, args=(x,))
    time.sleep(0.01)
print(f"rank {rank} done", flush=True)
