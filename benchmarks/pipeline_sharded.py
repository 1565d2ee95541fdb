"""Pipeline x sharded: PipelineStrategy(sharding=ShardingOptions()) against the same composition
written by hand with torch's own pieces, in one run.

K pipeline stages x D copies (default 2 x 2: 4 processes over gloo, one thread each). Each stage's
layers are sharded over its copies. The hand-written side is what a user of torch writes:
``init_device_mesh`` with ("dp", "pp") axes, ``fully_shard`` on every Linear of a stage over the
"dp" group (sum-type reductions: gloo has no AVG), ``torch.distributed.pipelining``'s
``PipelineStage`` over the "pp" group and its ``Schedule1F1B`` (or ``ScheduleGPipe``), which
reduce-scatter once per step as stratagem does. The same MLP, data and split on both; the two
alternate in rounds so machine noise hits both alike; samples/s is the median over rounds.

Run: ``torchrun --nproc-per-node 4 benchmarks/pipeline_sharded.py [--schedule gpipe] [--width 1024]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import stratagem as sg

K = 2  # pipeline stages


def make_mlp(width: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(layers - 2):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, 10))
    return nn.Sequential(*mods)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, default=2, help="D: data-parallel copies of the pipeline")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--steps", type=int, default=4, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rematerialize", default="auto",
                        help="stratagem's (its default, auto, keeps activations that fit, as torch's stage keeps them)")
    args = parser.parse_args()

    strategy = sg.PipelineStrategy(
        K, args.microbatches, schedule=args.schedule, data_parallel=args.copies, devices="cpu",
        sharding=sg.ShardingOptions(), rematerialize=args.rematerialize,
    )  # fmt: skip
    torch.set_num_threads(1)
    rank = dist.get_rank()
    stage, copy = rank % K, rank // K
    per_copy = args.global_batch // args.copies
    g = torch.Generator().manual_seed(copy)
    x = torch.randn(per_copy, 64, generator=g)
    y = torch.randint(0, 10, (per_copy,), generator=g)
    loss_fn = nn.CrossEntropyLoss()

    # --- stratagem
    torch.manual_seed(0)
    with strategy.scope():
        model = make_mlp(args.width, args.layers)
        pipe = strategy.pipeline(model, loss_fn, verbose=False)
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    balance = [len(strategy.partition.layers(c)) for c in range(K)]  # type: ignore[union-attr]

    def ours() -> None:
        strategy.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()

    # --- by hand: fully_shard over "dp", PipelineStage over "pp", the same split
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mesh = init_device_mesh("cpu", (args.copies, K), mesh_dim_names=("dp", "pp"))
    torch.manual_seed(0)
    layers = list(make_mlp(args.width, args.layers))
    start = sum(balance[:stage])
    part = nn.Sequential(*layers[start : start + balance[stage]])
    for layer in part:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["dp"])
    fully_shard(part, mesh=mesh["dp"])
    for m in part.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)  # summed over copies, loss scaled by the global batch
    hand_stage = PipelineStage(part, stage, K, torch.device("cpu"), group=mesh["pp"].get_group())
    n_global = args.global_batch

    def scaled_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # torch's schedule averages micro-batch losses over M: scale so the gradient is the
        # global batch's mean, as stratagem's
        return nn.functional.cross_entropy(out, target, reduction="sum") * args.microbatches / n_global

    sched = (Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe)(
        hand_stage, args.microbatches, loss_fn=scaled_loss
    )
    hand_opt = torch.optim.Adam(part.parameters(), lr=1e-3)

    def hand() -> None:
        if stage == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        hand_opt.step()
        hand_opt.zero_grad()

    def timed(step: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        dist.barrier()
        return args.global_batch * args.steps / (time.perf_counter() - t0)

    params = sum(p.numel() for p in make_mlp(args.width, args.layers).parameters())
    runs: dict[str, list[float]] = {"stratagem": [], "by hand": []}
    steps: dict[str, Callable[[], None]] = {"stratagem": ours, "by hand": hand}
    for step in steps.values():
        timed(step)  # warm-up (torch's stage infers its shapes here)
    for _ in range(args.rounds):
        for name, step in steps.items():
            runs[name].append(timed(step))
    med = {name: statistics.median(v) for name, v in runs.items()}
    if rank == 0:
        print(
            f"MLP {params / 1e6:.2f} M parameters ({args.layers} Linear, width {args.width}), "
            f"{K} stages x {args.copies} copies sharded, {args.schedule}, M={args.microbatches}, "
            f"rematerialize={args.rematerialize!r}, global batch "
            f"{args.global_batch}, Adam, gloo, 1 thread per process, {args.rounds} rounds x {args.steps} steps"
        )
        for name, v in runs.items():
            print(f"{name:10s} {med[name]:8.1f} samples/s  (rounds: {', '.join(f'{r:.0f}' for r in v)})")
        ratio = med["stratagem"] / med["by hand"]
        print(f"ratio stratagem / by hand (fully_shard + torch.distributed.pipelining): {ratio:.3f}")
        print(f"RESULT pipeline_sharded_vs_hand={ratio:.4f}")


if __name__ == "__main__":
    main()
