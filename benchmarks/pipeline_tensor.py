"""Pipeline x tensor: PipelineStrategy(layout_map=...) against the same composition written by
hand with torch's own pieces, in one run.

K pipeline stages x T tensor-parallel processes (default 2 x 2: 4 processes over gloo, one
thread each). The model: an input Linear, L residual MLP blocks (a transformer's MLP: fc1 split
by output features, fc2 by input features, Megatron's pair), a head. The hand-written side is
what a user of torch writes: ``init_device_mesh`` with ("pp", "tp") axes, ``parallelize_module``
with torch's ``ColwiseParallel`` / ``RowwiseParallel`` on each block of a stage over "tp",
``torch.distributed.pipelining``'s ``PipelineStage`` over "pp" and its ``Schedule1F1B`` (or
``ScheduleGPipe``). The same model, data and split on both; the two alternate in rounds so
machine noise hits both alike; samples/s is the median over rounds.

Run: ``torchrun --nproc-per-node 4 benchmarks/pipeline_tensor.py [--schedule gpipe] [--width 1024]``.
Pipeline x tensor x data: ``torchrun --nproc-per-node 8 benchmarks/pipeline_tensor.py --data 2``
(2 copies x 2 stages x 2 tensor-parallel; stratagem's ``data_parallel=2`` against the hand-written
stage's gradients all-reduced over a ("dp", "pp", "tp") mesh's "dp" group after each step, as a
user without a data-parallel wrapper for a pipeline stage writes it).
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

K, T = 2, 2  # pipeline stages, tensor-parallel processes per stage


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def make_model(width: int, blocks: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, width), *[Block(width) for _ in range(blocks)], nn.Linear(width, 10))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--steps", type=int, default=4, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data", type=int, default=1, help="data-parallel copies of the pipeline (8 processes for 2)")
    parser.add_argument("--rematerialize", default="auto",
                        help="stratagem's (its default, auto, keeps activations that fit, as torch's stage keeps them)")
    args = parser.parse_args()

    layout_map = sg.LayoutMap(sg.DeviceMesh((T,), ("model",)))
    layout_map[r"fc1\.weight"] = ("model", None)
    layout_map[r"fc2\.weight"] = (None, "model")
    n_layers = args.blocks + 2
    balance = [n_layers // 2, n_layers - n_layers // 2]
    strategy = sg.PipelineStrategy(
        K, args.microbatches, schedule=args.schedule, devices="cpu", layout_map=layout_map,
        rematerialize=args.rematerialize, balance=balance, data_parallel=args.data,
    )  # fmt: skip
    torch.set_num_threads(1)
    rank = dist.get_rank()
    stage = (rank // T) % K
    copy = rank // (K * T)
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(args.global_batch, 64, generator=g)
    ys = torch.randint(0, 10, (args.global_batch,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    x, y = next(iter(strategy.experimental_distribute_dataset([(xs, ys)])))  # this copy's share
    part_n = args.global_batch // args.data
    x_hand, y_hand = xs[copy * part_n : (copy + 1) * part_n], ys[copy * part_n : (copy + 1) * part_n]

    # --- stratagem
    torch.manual_seed(0)
    with strategy.scope():
        pipe = strategy.pipeline(make_model(args.width, args.blocks), loss_fn, verbose=False)
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)

    def ours() -> None:
        strategy.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()

    # --- by hand: parallelize_module over "tp", PipelineStage over "pp", the same split
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (args.data, K, T), mesh_dim_names=("dp", "pp", "tp"))
    torch.manual_seed(0)
    layers = list(make_model(args.width, args.blocks))
    start = sum(balance[:stage])
    part = nn.Sequential(*layers[start : start + balance[stage]])
    for layer in part:
        if isinstance(layer, Block):
            parallelize_module(layer, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    hand_stage = PipelineStage(part, stage, K, torch.device("cpu"), group=mesh["pp"].get_group())

    def scaled_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # torch's schedule averages micro-batch losses over M: the gradient of the batch's mean
        return nn.functional.cross_entropy(out, target, reduction="sum") * args.microbatches / args.global_batch

    sched = (Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe)(hand_stage, args.microbatches, loss_fn=scaled_loss)
    hand_opt = torch.optim.Adam(part.parameters(), lr=1e-3)
    dp_group = mesh["dp"].get_group() if args.data > 1 else None

    def hand() -> None:
        if stage == 0:
            sched.step(x_hand)
        else:
            sched.step(target=y_hand, losses=[])
        if dp_group is not None:  # the copies' gradients summed (each copy's loss is scaled by the global batch)
            from torch.distributed.tensor import DTensor

            for p in part.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=dp_group)
        hand_opt.step()
        hand_opt.zero_grad()

    def timed(step: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        dist.barrier()
        return args.global_batch * args.steps / (time.perf_counter() - t0)

    params = sum(p.numel() for p in make_model(args.width, args.blocks).parameters())
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
            f"model {params / 1e6:.2f} M parameters ({args.blocks} MLP blocks, width {args.width}), "
            f"{args.data} copies x {K} stages x {T} tensor-parallel, {args.schedule}, M={args.microbatches}, "
            f"rematerialize={args.rematerialize!r}, global batch {args.global_batch}, Adam, gloo, "
            f"1 thread per process, {args.rounds} rounds x {args.steps} steps"
        )
        for name, v in runs.items():
            print(f"{name:10s} {med[name]:8.1f} samples/s  (rounds: {', '.join(f'{r:.0f}' for r in v)})")
        ratio = med["stratagem"] / med["by hand"]
        print(f"ratio stratagem / by hand (parallelize_module + torch.distributed.pipelining): {ratio:.3f}")
        print(f"RESULT pipeline_tensor_vs_hand={ratio:.4f}")


if __name__ == "__main__":
    main()
