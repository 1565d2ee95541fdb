"""TPUStrategy against a hand-written torch_xla SPMD loop, measured in one run.

The same MLP and the same global batches on XLA's CPU backend (PJRT_DEVICE=CPU,
CPU_NUM_DEVICES=N: N XLA devices in one process). The hand-written loop is what the PyTorch/XLA
SPMD guide shows: the model moved to the XLA device, each batch moved and ``mark_sharding``-ed
over a 1-D data mesh, ``torch_xla.sync()`` after each step. TPUStrategy reads the batches
through ``experimental_distribute_dataset`` (a stratagem Dataset) and ``strategy.run``. Rounds
alternate so machine noise hits both alike; samples/s is the median over rounds.

Run (in the XLA environment scripts/test_xla.sh makes):
``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python benchmarks/tpu.py``
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch import nn

import stratagem as sg


def make_mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--list-input", action="store_true", help="TPUStrategy reads a list of batches")
    args = parser.parse_args()

    resolver = sg.cluster_resolver.TPUClusterResolver(tpu=None)
    sg.connect_to_cluster(resolver)
    sg.initialize_tpu_system(resolver)
    strategy = sg.TPUStrategy(resolver)
    n = strategy.num_replicas_in_sync

    import torch_xla
    import torch_xla.distributed.spmd as xs

    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.global_batch * args.steps, 256, generator=g)
    y = torch.randint(0, 10, (args.global_batch * args.steps,), generator=g)
    loss_fn = nn.CrossEntropyLoss()

    # --- stratagem ---
    with strategy.scope():
        model = make_mlp(args.width)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dist = strategy.experimental_distribute_dataset(sg.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch).prefetch(sg.data.AUTOTUNE))
    if args.list_input:
        dist = strategy.experimental_distribute_dataset([(x[i : i + args.global_batch], y[i : i + args.global_batch]) for i in range(0, len(x), args.global_batch)])

    def step(batch):
        xb, yb = batch
        loss = loss_fn(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    def ours() -> float:
        t0 = time.perf_counter()
        for batch in dist:
            loss = strategy.run(step, args=(batch,))
        loss.cpu()  # wait for the last step
        return time.perf_counter() - t0

    # --- hand-written torch_xla SPMD ---
    device = torch_xla.device()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    ref = make_mlp(args.width).to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    batches = [(x[i : i + args.global_batch], y[i : i + args.global_batch]) for i in range(0, len(x), args.global_batch)]

    def theirs() -> float:
        t0 = time.perf_counter()
        for xb, yb in batches:
            xb, yb = xb.to(device), yb.to(device)
            xs.mark_sharding(xb, mesh, ("data", None))
            xs.mark_sharding(yb, mesh, ("data",))
            loss = loss_fn(ref(xb), yb)
            ref_opt.zero_grad()
            loss.backward()
            ref_opt.step()
            torch_xla.sync()
        loss.cpu()
        return time.perf_counter() - t0

    ours(), theirs()  # compile both
    a, b = [], []
    for _ in range(args.rounds):
        a.append(len(x) / ours())
        b.append(len(x) / theirs())
    sa, sb = statistics.median(a), statistics.median(b)
    print(f"{n} XLA CPU devices, MLP width {args.width}, global batch {args.global_batch}, {args.steps} steps x {args.rounds} rounds")
    print(f"TPUStrategy        {sa:10.0f} samples/s")
    print(f"hand-written SPMD  {sb:10.0f} samples/s")
    print(f"ratio {sa / sb:.3f}")


if __name__ == "__main__":
    main()
