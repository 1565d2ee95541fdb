"""stratagem.function against the eager step, under MirroredStrategy, measured in one run.

The same residual MLP (LayerNorm, GELU: element-wise work that inductor fuses), Adam, and data
on every replica; the step is forward, ``compute_average_loss``, backward (the gradient reducer's
all-reduce runs eagerly between compiled regions) and the optimizer update. One model is stepped
eagerly, a copy with the ``stratagem.function`` of the same step; rounds alternate so machine
noise hits both alike. Prints the compile time (first call), the recompilations after it (the
contract: 0), the steps/s medians and the ratio compiled / eager (target >= 1.0).
Run: ``python benchmarks/compiled_step.py [--replicas 2] [--backend inductor]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

import stratagem as sg


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def make_model(width: int, depth: int) -> nn.Module:
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.LayerNorm(width), nn.Linear(width, 1))


def bench(args: argparse.Namespace) -> dict[str, Any]:
    strategy = sg.MirroredStrategy("cpu", num_replicas=args.replicas)
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        with strategy.scope():
            models.append(make_model(args.width, args.depth))
            opts.append(torch.optim.Adam(models[-1].parameters(), lr=1e-3))

    def make_step(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            per_example = (model(x) - y).square().mean(dim=1)
            loss = sg.compute_average_loss(per_example)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    eager = make_step(models[0], opts[0])
    compiled = sg.function(make_step(models[1], opts[1]), jit_compile=True, backend=args.backend)
    g = torch.Generator().manual_seed(strategy.extended.replica_id if hasattr(strategy.extended, "replica_id") else 0)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g)) for _ in range(8)]

    t = time.perf_counter()
    strategy.run(compiled, args=batches[0])
    compile_s = time.perf_counter() - t
    strategy.run(eager, args=batches[0])
    rates: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name, fn in (("eager", eager), ("compiled", compiled)):
            t = time.perf_counter()
            for i in range(args.steps):
                strategy.run(fn, args=batches[i % len(batches)])
            rates[name].append(args.steps / (time.perf_counter() - t))
    diff = max((a - b).abs().max().item() for a, b in zip(models[0].parameters(), models[1].parameters()))
    return {
        "compile_s": compile_s,
        "recompilations": compiled.recompilations,
        "eager": statistics.median(rates["eager"]),
        "compiled": statistics.median(rates["compiled"]),
        "max_param_diff": diff,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="per replica")
    p.add_argument("--steps", type=int, default=30, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    r = sg.launch(bench, args, num_replicas=args.replicas, timeout=900)
    print(
        f"compiled step ({args.backend}) vs eager, MirroredStrategy on {args.replicas} CPU replicas, "
        f"width {args.width} depth {args.depth} batch {args.batch}/replica\n"
        f"  first call (compile): {r['compile_s']:.1f} s; recompilations after it: {r['recompilations']}\n"
        f"  eager:    {r['eager']:.1f} steps/s\n"
        f"  compiled: {r['compiled']:.1f} steps/s\n"
        f"  ratio compiled/eager: {r['compiled'] / r['eager']:.2f}x "
        f"(params after the same steps differ by at most {r['max_param_diff']:.1e})"
    )


if __name__ == "__main__":
    main()
