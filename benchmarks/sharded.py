"""ShardedStrategy against a hand-written ``fully_shard`` loop and MirroredStrategy, in one run.

The same MLP (about 5.3 M parameters), global batch 512, SGD, 2 CPU processes over gloo, one
thread each. The hand-written loop is what a user of torch's FSDP2 writes: ``fully_shard`` on
every Linear, then on the root (gloo needs sum-type reductions, so it sets them too). The three
train on one process group, alternating in rounds so machine noise hits all alike; samples/s is
the median over rounds. Also printed: each rank's bytes of parameters + gradients + optimizer
state (from each tensor's local storage) and the bytes each rank sends per step by formula.
Run: ``torchrun --nproc-per-node 2 benchmarks/sharded.py [--optimizer adam]`` (two strategies in
one script need a launcher; a self-launched script starts its replicas once).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import stratagem as sg


def make_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(),
        nn.Linear(2048, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 10),
    )  # fmt: skip


def local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    seen: set[int] = set()
    total = 0
    tensors: list[Any] = [t for p in model.parameters() for t in (p, p.grad)]
    tensors += [v for state in opt.state.values() for v in state.values()]
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    args = parser.parse_args()

    sharded = sg.ShardedStrategy(num_replicas=args.replicas, devices="cpu")
    mirrored = sg.MirroredStrategy(devices="cpu")  # joins the same job
    torch.set_num_threads(1)
    n = sharded.num_replicas_in_sync
    per_replica = args.global_batch // n
    chief = sharded.extended.replica_id == 0
    g = torch.Generator().manual_seed(sharded.extended.replica_id)
    x = torch.randn(per_replica, 1024, generator=g)
    y = torch.randint(0, 10, (per_replica,), generator=g)
    loss_fn = nn.CrossEntropyLoss(reduction="none")

    def optimizer(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-3) if args.optimizer == "adam" else torch.optim.SGD(params, lr=0.01)

    def strategy_step(strategy: sg.Strategy) -> tuple[Callable[[], None], nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        with strategy.scope():
            model = make_mlp()
            opt = optimizer(model.parameters())

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            sg.compute_average_loss(loss_fn(model(x), y), global_batch_size=args.global_batch).backward()
            opt.step()

        return (lambda: strategy.run(step, args=(x, y))), model, opt

    ours, sharded_model, sharded_opt = strategy_step(sharded)
    mirror, mirrored_model, mirrored_opt = strategy_step(mirrored)

    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    hand = make_mlp()
    for layer in hand:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(hand)
    for m in hand.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no AVG
    hand_opt = optimizer(hand.parameters())

    def hand_step() -> None:
        hand_opt.zero_grad()
        loss_fn(hand(x), y).mean().backward()
        hand_opt.step()

    def timed(step: Callable[[], None]) -> float:
        sharded.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sharded.barrier()
        return args.global_batch * args.steps / (time.perf_counter() - start)

    params = sum(p.numel() for p in mirrored_model.parameters())
    if chief:
        print(f"MLP {params / 1e6:.2f} M parameters, global batch {args.global_batch}, {args.optimizer}, "
              f"{n} processes (gloo, 1 thread each), {args.rounds} rounds x {args.steps} steps")  # fmt: skip
    runs: dict[str, list[float]] = {"ShardedStrategy": [], "hand-written fully_shard": [], "MirroredStrategy": []}
    steps = dict(zip(runs, (ours, hand_step, mirror)))
    for step in steps.values():
        timed(step)  # warm-up
    for _ in range(args.rounds):
        for name, step in steps.items():
            runs[name].append(timed(step))
    med = {name: statistics.median(v) for name, v in runs.items()}
    mem = {
        "ShardedStrategy": local_bytes(sharded_model, sharded_opt),
        "hand-written fully_shard": local_bytes(hand, hand_opt),
        "MirroredStrategy": local_bytes(mirrored_model, mirrored_opt),
    }
    p_bytes = params * 4
    sent = {  # per rank per step, ring algorithms: all-reduce 2(N-1)/N P, all-gather/reduce-scatter (N-1)/N P
        "ShardedStrategy": 3 * (n - 1) / n * p_bytes,  # all-gather fwd + bwd, reduce-scatter
        "hand-written fully_shard": 3 * (n - 1) / n * p_bytes,
        "MirroredStrategy": 2 * (n - 1) / n * p_bytes,
    }
    if chief:
        for name, v in runs.items():
            print(f"{name:26s} {med[name]:8.1f} samples/s  state {mem[name] / 2**20:6.1f} MiB/rank  "
                  f"sends {sent[name] / 2**20:6.1f} MiB/step  (rounds: {', '.join(f'{r:.0f}' for r in v)})")  # fmt: skip
        print(f"ratio ShardedStrategy / hand-written fully_shard: {med['ShardedStrategy'] / med['hand-written fully_shard']:.3f}")
        print(f"ratio ShardedStrategy / MirroredStrategy: {med['ShardedStrategy'] / med['MirroredStrategy']:.3f}")
        print(f"RESULT sharded_vs_fully_shard={med['ShardedStrategy'] / med['hand-written fully_shard']:.4f}")


if __name__ == "__main__":
    main()
