"""Benchmark: a 2-stage pipeline on 2 single-threaded CPU processes against the bubble formula and
torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B) on the same split and data.

Run: ``python benchmarks/pipeline.py`` (it starts its second process itself, as a user's script
would). For M in {1, 2, 4, 8, 16} it prints the time per mini-batch of stratagem's GPipe and 1F1B
(with and without re-materialization) and of torch's schedules, the ideal time from the bubble
formula, ``T1 * (M + K - 1) / (M * K)`` with T1 the unsplit model's forward+backward on one
single-threaded process, and the activation memory each stage holds for backward at its peak
(autograd-saved tensors plus the inputs kept for recomputation), with ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref
from typing import Any

import torch
from torch import nn

from stratagem.distribute.pipeline_strategy import PipelineStrategy

K = 2


def build(width: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, 10))
    return nn.Sequential(*mods)


class ActivationMeter:
    """Peak bytes of autograd-saved tensors (deduplicated by storage, parameters excluded) plus
    ``extra()`` (inputs a stage keeps for recomputation), sampled whenever either changes."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.extra = lambda: 0

    def sample(self) -> None:
        self.peak = max(self.peak, self.live + self.extra())

    def pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if key in self.skip or t.device.type == "meta":
            return t
        if self.refs.get(key, 0) == 0:
            self.sizes[key] = t.untyped_storage().nbytes()
            self.live += self.sizes[key]
        self.refs[key] = self.refs.get(key, 0) + 1
        self.sample()
        return _Held(t, key, weakref.ref(self))

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    def release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.refs[key]

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    __slots__ = ("t", "key", "meter")

    def __init__(self, t: torch.Tensor, key: int, meter: weakref.ref[ActivationMeter]) -> None:
        self.t, self.key, self.meter = t, key, meter

    def __del__(self) -> None:
        m = self.meter()
        if m is not None:
            m.release(self.key)


def timed(step: Any, steps: int, warmup: int, barrier: Any) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks (split evenly)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()

    first = PipelineStrategy(K, 1, checkpoint="never")  # starts the second process, joins the job
    torch.set_num_threads(1)
    rank = first.stage
    ext = first._pipeline_ext
    world = ext.world
    barrier = world.barrier
    n_mods = 2 * args.layers + 1
    balance = [2 * (args.layers // 2), n_mods - 2 * (args.layers // 2)]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    loss_fn = nn.CrossEntropyLoss()

    # T1: the unsplit model on one single-threaded process (the other waits at a barrier)
    t1 = 0.0
    if rank == 0:
        torch.manual_seed(0)
        full = build(args.width, args.layers)

        def unsplit() -> None:
            loss_fn(full(x), y).backward()
            full.zero_grad(set_to_none=True)

        t1 = timed(unsplit, args.steps, 1, lambda: None)
        del full
    barrier()
    t1 = float(world.broadcast_object(t1, src=0))

    rows = []
    for m in args.micro:
        row: dict[str, Any] = {"M": m, "ideal": t1 * (m + K - 1) / (m * K)}
        for sched in ("gpipe", "1f1b"):
            for ck in ("never", "except_last"):
                s = PipelineStrategy(K, m, schedule=sched, checkpoint=ck, balance=balance)
                with s.scope():
                    torch.manual_seed(0)
                    pipe = s.pipeline(build(args.width, args.layers), loss_fn, verbose=False)

                def ours(pipe: Any = pipe, s: Any = s) -> None:
                    s.run(pipe.train_step, args=(x, y))
                    for p in pipe.parameters():
                        p.grad = None

                row[f"{sched}/{ck}"] = timed(ours, args.steps, 1, barrier)
                meter = ActivationMeter(list(pipe.parameters()))
                stage = pipe.stage
                # inputs kept for recomputation (stage 0's are views of the batch: free)
                meter.extra = lambda st=stage: sum(  # type: ignore[misc]
                    v.input.numel() * v.input.element_size()
                    for v in st._saved.values()
                    if v.output is None and isinstance(v.input, torch.Tensor) and st.index > 0
                )
                fwd, rec = stage.forward, stage.recompute

                def fwd_hook(*a: Any, _f: Any = fwd, _m: Any = meter, **kw: Any) -> Any:
                    out = _f(*a, **kw)
                    _m.sample()
                    return out

                stage.forward = fwd_hook  # type: ignore[method-assign]
                with meter.hooks():
                    ours()
                stage.forward, stage.recompute = fwd, rec  # type: ignore[method-assign]
                peaks = world.all_gather_object(meter.peak)
                row[f"mem {sched}/{ck}"] = peaks
        for name in ("GPipe", "1F1B"):
            row[f"torch {name}"], row[f"mem torch {name}"] = torch_pipelining(
                name, m, args, balance, x, y, loss_fn, rank, world, barrier
            )
        rows.append(row)
        if rank == 0:
            print(f"done M={m}", flush=True)

    if rank == 0:
        report(rows, t1, args)


def torch_pipelining(
    name: str, m: int, args: Any, balance: list[int], x: Any, y: Any, loss_fn: Any,
    rank: int, world: Any, barrier: Any,
) -> tuple[float, list[int]]:  # fmt: skip
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    full = build(args.width, args.layers)
    layers = list(full)
    start = sum(balance[:rank])
    part = nn.Sequential(*layers[start : start + balance[rank]])
    del full, layers
    stage = PipelineStage(part, rank, K, torch.device("cpu"))  # shapes inferred in the first step
    if name == "1F1B" and m < K:
        return float("nan"), [0] * K  # torch's Schedule1F1B needs M >= K
    cls = ScheduleGPipe if name == "GPipe" else Schedule1F1B
    sched = cls(stage, m, loss_fn=loss_fn)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        for p in part.parameters():
            p.grad = None

    t = timed(step, args.steps, 1, barrier)
    meter = ActivationMeter(list(part.parameters()))
    with meter.hooks():
        step()
    return t, world.all_gather_object(meter.peak)


def report(rows: list[dict[str, Any]], t1: float, args: Any) -> None:
    mib = 1024 * 1024
    print(
        f"\n2-stage MLP: {args.layers} x Linear({args.width}, {args.width})+ReLU, batch {args.batch}, "
        f"2 processes x 1 thread; unsplit model fwd+bwd on 1 thread T1 = {t1 * 1e3:.1f} ms"
    )
    print("times: ms per mini-batch (median of steps); ratio = ideal / measured (1.00 = ideal)")
    hdr = (f"{'M':>3} {'ideal':>7} | {'gpipe':>7} {'eff':>5} | {'gpipe+rm':>8} | {'1f1b':>7} {'eff':>5} | "
           f"{'torchGP':>7} {'ours/t':>6} | {'torch1F1B':>9} {'ours/t':>6}")  # fmt: skip
    print(hdr)
    for r in rows:
        g, g_rm, f = r["gpipe/never"], r["gpipe/except_last"], r["1f1b/never"]
        tg, tf = r["torch GPipe"], r["torch 1F1B"]
        print(
            f"{r['M']:>3} {r['ideal'] * 1e3:>7.1f} | {g * 1e3:>7.1f} {r['ideal'] / g:>5.2f} | "
            f"{g_rm * 1e3:>8.1f} | {f * 1e3:>7.1f} {r['ideal'] / f:>5.2f} | "
            f"{tg * 1e3:>7.1f} {tg / g:>6.2f} | "
            + (f"{tf * 1e3:>9.1f} {tf / f:>6.2f}" if tf == tf else f"{'-':>9} {'-':>6}")
        )
    print("  ours/t = torch's time / ours at the same schedule and memory (no re-materialization); "
          "> 1 means we are faster")
    print("\npeak activation memory held for backward, MiB per stage [stage 0, stage 1]")
    print(f"{'M':>3} | {'gpipe':>13} {'gpipe+rm':>13} | {'1f1b':>13} {'1f1b+rm':>13} | "
          f"{'torch GPipe':>13} {'torch 1F1B':>13}")  # fmt: skip

    def fmt(v: list[int]) -> str:
        if not any(v):
            return "-"
        return "[" + ", ".join(f"{b / mib:.1f}" for b in v) + "]"

    for r in rows:
        print(
            f"{r['M']:>3} | {fmt(r['mem gpipe/never']):>13} {fmt(r['mem gpipe/except_last']):>13} | "
            f"{fmt(r['mem 1f1b/never']):>13} {fmt(r['mem 1f1b/except_last']):>13} | "
            f"{fmt(r['mem torch GPipe']):>13} {fmt(r['mem torch 1F1B']):>13}"
        )
    print("  +rm: checkpoint='except_last' (re-materialization); others: checkpoint='never'; "
          "torch's Schedule1F1B needs M >= 2")


if __name__ == "__main__":
    main()
