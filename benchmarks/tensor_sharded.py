"""Tensor x sharded: ModelParallelStrategy on a ("data", "model") mesh with
``sharding=ShardingOptions()`` against the same composition written by hand with torch's own
pieces, in one run.

4 processes (2 data x 2 model, gloo, one thread each) train a stack of pre-norm transformer blocks
(separate q, k, v projections; attention through ``F.scaled_dot_product_attention``). The
hand-written side is what a torchtitan user writes: ``init_device_mesh`` with ("dp", "tp") axes,
``parallelize_module`` on each block over "tp" (q, k, v and the MLP's first layer column-wise with
local outputs, so attention runs on each process's own heads; o and the MLP's second layer
row-wise), then ``fully_shard`` on each block and the root over "dp" (sum-type reductions: gloo
has no AVG). stratagem is given the same split by a LayoutMap. The two alternate in rounds so
machine noise hits both alike; samples/s is the median over rounds.

Run: ``torchrun --nproc-per-node 4 benchmarks/tensor_sharded.py [--width 256] [--seq 64]``.
HSDP x TP: ``torchrun --nproc-per-node 8 benchmarks/tensor_sharded.py --shard-size 2`` (4 data x 2
model; stratagem's ``ShardingOptions(shard_size=2)`` against ``fully_shard`` over torchtitan's
("dp_replicate", "dp_shard") of a 3-D mesh).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import stratagem as sg

HEAD = 32  # features per attention head


class Block(nn.Module):
    """Pre-norm attention + MLP; the head count follows the (local) width, so the same code runs
    whole, on DTensors, or on a process's own heads."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.w1, self.w2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, -1, HEAD).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.w2(torch.relu(self.w1(self.norm2(x))))


def make_model(width: int, blocks: int) -> nn.Sequential:
    return nn.Sequential(*(Block(width) for _ in range(blocks)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shard-size", type=int, default=None,
                        help="HSDP x TP: shard over groups of this many data copies, replicate across them "
                        "(run on 8 processes: 4 data x 2 model, --shard-size 2)")  # fmt: skip
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "4"))
    copies = world // 2
    mesh = sg.DeviceMesh((copies, 2), ("data", "model"))
    layout = sg.LayoutMap(mesh)
    layout[r"\.(q|k|v|w1)\.weight$"] = ("model", None)
    layout[r"\.(o|w2)\.weight$"] = (None, "model")
    sharding = sg.ShardingOptions(shard_size=args.shard_size)
    strategy = sg.ModelParallelStrategy(mesh, layout, devices="cpu", sharding=sharding)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    dp = rank // 2  # the mesh is row-major: ranks 0, 1 are data copy 0 split over "model"
    n = args.global_batch
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(n, args.seq, args.width, generator=g)
    ys = torch.randn(n, args.seq, args.width, generator=g)

    def per_example(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean(dim=(1, 2))

    # --- stratagem: the global batch through the strategy's input pipeline
    torch.manual_seed(0)
    with strategy.scope():
        model = make_model(args.width, args.blocks)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    dist_data = list(strategy.experimental_distribute_dataset([(xs, ys)]))
    x_ours, y_ours = dist_data[0]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        sg.compute_average_loss(per_example(model(x), y)).backward()
        opt.step()

    def ours() -> None:
        strategy.run(step, args=(x_ours, y_ours))

    # --- by hand: parallelize_module over "tp", fully_shard over "dp"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if args.shard_size is None or args.shard_size == copies:
        tmesh = init_device_mesh("cpu", (copies, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh = tmesh["dp"]
    else:  # HSDP x TP: torchtitan's dp_replicate x dp_shard x tp
        shape = (copies // args.shard_size, args.shard_size, 2)
        tmesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        dp_mesh = tmesh["dp_replicate", "dp_shard"]
    torch.manual_seed(0)
    hand_model = make_model(args.width, args.blocks)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
            "w1": ColwiseParallel(), "w2": RowwiseParallel()}  # fmt: skip
    for block in hand_model:
        parallelize_module(block, tmesh["tp"], plan)
        fully_shard(block, mesh=dp_mesh)
    fully_shard(hand_model, mesh=dp_mesh)
    for m in hand_model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)  # summed over "dp", the loss scaled by the global batch
    hand_opt = torch.optim.Adam(hand_model.parameters(), lr=1e-4)
    part = n // copies
    x_hand, y_hand = xs[dp * part : (dp + 1) * part], ys[dp * part : (dp + 1) * part]

    def hand() -> None:
        hand_opt.zero_grad()
        (per_example(hand_model(x_hand), y_hand).sum() / n).backward()
        hand_opt.step()

    def timed(fn: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            fn()
        dist.barrier()
        return n * args.steps / (time.perf_counter() - t0)

    params = sum(p.numel() for p in make_model(args.width, args.blocks).parameters())
    runs: dict[str, list[float]] = {"stratagem": [], "by hand": []}
    steps: dict[str, Callable[[], None]] = {"stratagem": ours, "by hand": hand}
    for fn in steps.values():
        timed(fn)  # warm-up
    for _ in range(args.rounds):
        for name, fn in steps.items():
            runs[name].append(timed(fn))
    med = {name: statistics.median(v) for name, v in runs.items()}
    if rank == 0:
        print(
            f"transformer {params / 1e6:.2f} M parameters ({args.blocks} blocks, width {args.width}, seq "
            f"{args.seq}), {copies} data x 2 model"
            + (f" (HSDP: shard_size {args.shard_size})" if args.shard_size else "")
            + f", global batch {n}, Adam, gloo, 1 thread per process, "
            f"{args.rounds} rounds x {args.steps} steps"
        )
        for name, v in runs.items():
            print(f"{name:10s} {med[name]:8.1f} samples/s  (rounds: {', '.join(f'{r:.1f}' for r in v)})")
        ratio = med["stratagem"] / med["by hand"]
        print(f"ratio stratagem / by hand (parallelize_module + fully_shard): {ratio:.3f}")
        print(f"RESULT tensor_sharded_vs_hand={ratio:.4f}")


if __name__ == "__main__":
    main()
