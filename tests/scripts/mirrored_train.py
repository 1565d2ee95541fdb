"""A user's plain training script: `python mirrored_train.py [--fail-rank R] [--kill-rank R]`."""

import argparse
import os
import signal

import torch
from torch import nn

import stratagem as sg

parser = argparse.ArgumentParser()
parser.add_argument("--replicas", type=int, default=2)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

strategy = sg.MirroredStrategy(devices="cpu", num_replicas=args.replicas)
rank = strategy.extended.replica_id
torch.manual_seed(0)
with strategy.scope():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(x, y):
    opt.zero_grad()
    loss = sg.compute_average_loss((model(x).squeeze(1) - y) ** 2)
    loss.backward()
    opt.step()
    return loss.detach()


g = torch.Generator().manual_seed(0)
batches = [(torch.randn(8, 4, generator=g), torch.randn(8, generator=g)) for _ in range(args.steps)]
for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches)):
    if i == 1 and rank == args.fail_rank:
        raise RuntimeError(f"boom on replica {rank}")
    if i == 1 and rank == args.kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = strategy.reduce("sum", strategy.run(step, args=(x, y)))
checksum = strategy.reduce("sum", model.weight.detach().sum()).item()
if strategy.extended.should_checkpoint:
    print(f"DONE world={strategy.num_replicas_in_sync} checksum={checksum:.6f} launcher={strategy.cluster_spec.launcher}")
