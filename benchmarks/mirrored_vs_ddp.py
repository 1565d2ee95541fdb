"""MirroredStrategy against hand-written DistributedDataParallel, measured in one run.

The same MLP (about 5.3 M parameters), global batch 512, 2 CPU processes over gloo, one thread
each. Both train on the same process group, alternating in rounds so machine noise hits both
alike; samples/s is the median over rounds. Run: ``python benchmarks/mirrored_vs_ddp.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stratagem as sg


def make_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(),
        nn.Linear(2048, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8, help="steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="for both (DDP's default)")
    args = parser.parse_args()

    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=args.replicas, bucket_cap_mb=args.bucket_cap_mb)
    torch.set_num_threads(1)
    n = strategy.num_replicas_in_sync
    per_replica = args.global_batch // n
    chief = strategy.extended.should_checkpoint
    g = torch.Generator().manual_seed(strategy.extended.replica_id)
    x = torch.randn(per_replica, 1024, generator=g)
    y = torch.randint(0, 10, (per_replica,), generator=g)
    loss_fn = nn.CrossEntropyLoss(reduction="none")

    torch.manual_seed(0)
    with strategy.scope():
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def sg_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = sg.compute_average_loss(loss_fn(model(x), y), global_batch_size=args.global_batch)
        loss.backward()
        opt.step()
        return loss.detach()

    torch.manual_seed(0)
    ddp = DDP(make_mlp(), bucket_cap_mb=args.bucket_cap_mb)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def ddp_step() -> None:
        ddp_opt.zero_grad()
        loss_fn(ddp(x), y).mean().backward()
        ddp_opt.step()

    def timed(step: object) -> float:
        strategy.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()  # type: ignore[operator]
        strategy.barrier()
        return args.global_batch * args.steps / (time.perf_counter() - start)

    params = sum(p.numel() for p in model.parameters())
    if chief:
        print(f"MLP {params / 1e6:.2f} M parameters, global batch {args.global_batch}, "
              f"{n} processes (gloo, 1 thread each), {args.rounds} rounds x {args.steps} steps")
    timed(lambda: strategy.run(sg_step, args=(x, y)))  # warm-up both
    timed(ddp_step)
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(timed(lambda: strategy.run(sg_step, args=(x, y))))
        theirs.append(timed(ddp_step))
    a, b = statistics.median(ours), statistics.median(theirs)
    if chief:
        print(f"stratagem MirroredStrategy: {a:8.1f} samples/s   (rounds: {', '.join(f'{v:.0f}' for v in ours)})")
        print(f"torch DDP:                  {b:8.1f} samples/s   (rounds: {', '.join(f'{v:.0f}' for v in theirs)})")
        print(f"ratio stratagem / DDP: {a / b:.3f}")
        print(f"RESULT mirrored_vs_ddp={a / b:.4f}")


if __name__ == "__main__":
    main()
