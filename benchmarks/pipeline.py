"""Benchmark: a 2-stage pipeline on 2 single-threaded CPU processes against the bubble formula and
torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B) on the same
split and data.

Run: ``python benchmarks/pipeline.py`` (it starts its second process itself, as a user's script
would). For M in {1, 2, 4, 8, 16} it prints the time per mini-batch of stratagem's GPipe and 1F1B
(with and without re-materialization) and of torch's schedules, the ideal time from the bubble
formula, ``T1 * (M + K - 1) / (M * K)`` with T1 the unsplit model's forward+backward on one
single-threaded process, and the activation memory each stage holds for backward at its peak
(autograd-saved tensors plus the inputs kept for recomputation), with ratios. All variants run
interleaved, round by round, so they see the same load; the best round is reported.

``--shape mlp1024`` (8 x Linear(1024)+ReLU and a head, batch 256) and ``--shape transformer``
(4 pre-LN transformer blocks of width 256, sequence 128, batch 64) compare, at M = 8 (``--micro``),
stratagem's GPipe, 1F1B, zero-bubble and interleaved 1F1B (2 chunks per stage) with torch's
ScheduleGPipe, Schedule1F1B, ScheduleInterleavedZeroBubble (one stage per rank) and
ScheduleInterleaved1F1B (the same 4 chunks) on the same split and data, and with the
bubble bound ``T1' (M + K - 1) / (M K)`` (T1': the unsplit model over the same M micro-batches
on one single-threaded process); the order of the variants alternates round by round and
medians with their spread are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import weakref
from typing import Any

import torch
from torch import nn

from stratagem.distribute.strategies.pipeline import PipelineStrategy

K = 2
#: each of our schedules and the runner of torch's matching one (``--shape``)
THEIRS = {"gpipe": "torch GPipe", "1f1b": "torch 1F1B", "zero_bubble": "torch ZB",
          "interleaved_1f1b": "torch Interleaved"}  # fmt: skip


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


class _TokenLoss(nn.Module):
    """Cross-entropy over every token of [batch, seq, classes] logits (mean)."""

    reduction = "mean"

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(h.flatten(0, 1), y.flatten())


def build_shape(shape: str) -> tuple[nn.Sequential, list[int], Any, Any, nn.Module]:
    """The model, its 2-stage balance, a batch (x, y) and the loss of ``--shape``."""
    g = torch.Generator().manual_seed(0)
    if shape == "mlp1024":
        model = build(1024, 8)  # 17 layers: 8 on stage 0, 9 on stage 1
        x, y = torch.randn(256, 1024, generator=g), torch.randint(0, 10, (256,), generator=g)
        return model, [8, 9], x, y, nn.CrossEntropyLoss()
    if shape == "mlp256":  # the M sweep's model (--shape mlp) at one M, every schedule
        model = build(256, 16)  # 33 layers: 16 on stage 0, 17 on stage 1
        x, y = torch.randn(2048, 256, generator=g), torch.randint(0, 10, (2048,), generator=g)
        return model, [16, 17], x, y, nn.CrossEntropyLoss()
    width, seq, batch = 256, 128, 64
    blocks: list[nn.Module] = [
        nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        for _ in range(4)
    ]
    model = nn.Sequential(*blocks, nn.LayerNorm(width), nn.Linear(width, 10))
    x = torch.randn(batch, seq, width, generator=g)
    y = torch.randint(0, 10, (batch, seq), generator=g)
    return model, [2, 4], x, y, _TokenLoss()


def chunk_balance(shape: str, args: Any) -> list[int]:
    """The layers of each of the K x 2 chunks of interleaved 1F1B (virtual_stages=2)."""
    if shape == "mlp1024":
        return [4, 4, 4, 5]  # 2 [Linear, ReLU] pairs per chunk, the head on the last
    if shape == "mlp256":
        return [8, 8, 8, 9]  # 4 [Linear, ReLU] pairs per chunk, the head on the last
    if shape == "transformer":
        return [1, 1, 1, 3]  # a block per chunk, LayerNorm and head on the last
    n_mods = 2 * args.layers + 1
    q = 2 * (args.layers // 4)
    return [q, q, q, n_mods - 3 * q]


def shapes_main(args: Any) -> None:
    first = PipelineStrategy(K, 1, rematerialize="never", devices="cpu")
    torch.set_num_threads(1)
    rank = first.stage
    world = first._pipeline_ext.world
    _, balance, x, y, loss_fn = build_shape(args.shape)
    torch.manual_seed(0)
    full = build_shape(args.shape)[0] if rank == 0 else None
    rows = []
    for m in args.micro:

        def unsplit(m: int = m) -> None:
            if full is not None:
                for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
                    (loss_fn(full(xs), ys) * (len(xs) / len(x))).backward()
                full.zero_grad(set_to_none=True)

        runners: dict[str, Any] = {"T1'": unsplit}
        for sched in ("gpipe", "1f1b", "zero_bubble", "interleaved_1f1b"):
            bal = chunk_balance(args.shape, args) if sched == "interleaved_1f1b" else balance
            s = PipelineStrategy(K, m, schedule=sched, rematerialize="never", balance=bal, devices="cpu")
            with s.scope():
                torch.manual_seed(0)
                pipe = s.pipeline(build_shape(args.shape)[0], loss_fn, verbose=False)

            def ours(pipe: Any = pipe, s: Any = s) -> None:
                s.run(pipe.train_step, args=(x, y))
                for p in pipe.parameters():
                    p.grad = None

            runners[sched] = ours
        for name in ("GPipe", "1F1B", "ZB", "Interleaved"):
            bal = chunk_balance(args.shape, args) if name == "Interleaved" else balance
            try:
                step, _ = torch_pipelining(name, m, args, bal, x, y, loss_fn, rank)
                step()
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                if rank == 0:
                    print(f"torch {name} at M={m}: not run ({type(e).__name__}: {e})", flush=True)
                continue
            runners[f"torch {name}"] = step
        if args.noise and "torch 1F1B" in runners:
            # torch's 1F1B again, built and timed as a variant of its own: how far apart two
            # identical variants measure on this machine (the noise floor of every ratio above)
            step, _ = torch_pipelining("1F1B", m, args, balance, x, y, loss_fn, rank)
            step()
            runners["torch 1F1B again"] = step
        walls: dict[str, list[float]] = {k: [] for k in runners}
        cpus: dict[str, list[float]] = {k: [] for k in runners}
        keys = list(runners)
        if args.pairs:  # each schedule next to torch's: [T1', gpipe, torch GPipe, 1f1b, torch 1F1B, ...]
            keys = ["T1'"] + [k for ours in THEIRS for k in (ours, THEIRS[ours]) if k in runners]
            keys += [k for k in runners if k not in keys]
        for r in range(args.rounds + 1):
            for key in keys if r % 2 == 0 else keys[::-1]:  # alternate the order round by round
                world.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                runners[key]()
                if r:
                    walls[key].append(time.perf_counter() - t0)
                    cpus[key].append(time.process_time() - c0)
        walls["T1'"] = world.broadcast_object(walls["T1'"], src=0)
        # CPU seconds of the two processes together (median round): less sensitive to the load
        both = world.all_gather_object({k: statistics.median(v) for k, v in cpus.items()})
        walls.update({"cpu " + k: [sum(c[k] for c in both)] for k in cpus})
        rows.append((m, walls))
        if rank == 0:
            print(f"done M={m}", flush=True)
    if rank == 0:
        shape_report(rows, args)


def shape_report(rows: list[tuple[int, dict[str, list[float]]]], args: Any) -> None:
    what = {
        "mlp1024": "8 x [Linear(1024), ReLU] + Linear(1024, 10), batch 256",
        "mlp256": "16 x [Linear(256), ReLU] + Linear(256, 10), batch 2048",
        "transformer": "4 pre-LN transformer blocks (width 256, 4 heads, MLP 1024) + LayerNorm + Linear, "
        "batch 64 x seq 128",
    }[args.shape]
    print(f"\n2-stage pipeline: {what}; 2 processes x 1 thread; {args.rounds} rounds, order alternating")
    print("ms per mini-batch: median [min-max]; bound = T1' (M+K-1)/(MK); x bound = median / bound;")
    print("vs torch = torch's median / ours (> 1: stratagem faster); paired = median over rounds of "
          "torch's time / ours in that round")
    for m, walls in rows:
        med = {k: statistics.median(v) for k, v in walls.items()}
        bound = med["T1'"] * (m + K - 1) / (m * K)
        t1 = med["T1'"]
        print(f"M={m}: T1' {t1 * 1e3:.1f} ms, bound {bound * 1e3:.1f} ms")

        def cell(k: str, walls: dict[str, list[float]] = walls) -> str:
            v = walls[k]
            return f"{statistics.median(v) * 1e3:7.1f} [{min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}]"

        for ours, theirs in THEIRS.items():
            line = f"  {ours:<12} {cell(ours)}  x bound {med[ours] / bound:4.2f}"
            if theirs in walls:
                # also the median of the rounds' own ratios (both ran in the same round, so it
                # is less moved by load that changes from round to round)
                paired = statistics.median(t / o for t, o in zip(walls[theirs], walls[ours]))
                line += f" | {theirs:<12} {cell(theirs)}  vs torch {med[theirs] / med[ours]:4.2f}"
                line += f" (paired {paired:4.2f})"
            print(line)
        if "torch 1F1B again" in walls:
            again = walls["torch 1F1B again"]
            paired = statistics.median(t / a for t, a in zip(walls["torch 1F1B"], again))
            print(f"  noise floor: torch 1F1B {cell('torch 1F1B')} vs the same again {cell('torch 1F1B again')}: "
                  f"{med['torch 1F1B'] / med['torch 1F1B again']:4.2f} (paired {paired:4.2f})")  # fmt: skip
        cpu = "  CPU ms per step, both processes: " + ", ".join(
            f"{k} {walls['cpu ' + k][0] * 1e3:.0f}" for k in walls if not k.startswith("cpu ") and "cpu " + k in walls
        )
        print(cpu)
    print(f"  load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["mlp", "mlp256", "mlp1024", "transformer"], default="mlp",
                    help="mlp: the M sweep below; mlp256 (the same model) / mlp1024 / transformer: "
                         "every schedule at --micro (8)")  # fmt: skip
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16, help="[Linear, ReLU] blocks (split evenly)")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up)")
    ap.add_argument("--micro", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--pairs", action="store_true",
                    help="with --shape: run each schedule next to torch's matching one (the order of "
                         "the variants still alternates round by round)")  # fmt: skip
    ap.add_argument("--noise", action="store_true",
                    help="with --shape: also time torch's 1F1B a second time as a variant of its own "
                         "and print how far apart the two measure (the noise floor of the ratios)")  # fmt: skip
    args = ap.parse_args()
    if args.shape != "mlp":
        if args.micro == [1, 2, 4, 8, 16]:
            args.micro = [8]
        shapes_main(args)
        return

    first = PipelineStrategy(K, 1, rematerialize="never", devices="cpu")  # starts the second process, joins the job
    torch.set_num_threads(1)
    rank = first.stage
    world = first._pipeline_ext.world
    n_mods = 2 * args.layers + 1
    balance = [2 * (args.layers // 2), n_mods - 2 * (args.layers // 2)]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    torch.manual_seed(0)
    full = build(args.width, args.layers) if rank == 0 else None

    def unsplit(m: int) -> None:
        """The unsplit model on rank 0 (rank 1 waits), micro-batch by micro-batch if m > 1."""
        if full is not None:
            for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
                loss_fn(full(xs), ys).backward()
            full.zero_grad(set_to_none=True)

    rows = []
    for m in args.micro:
        runners: dict[str, Any] = {"T1": lambda: unsplit(1), "T1'": lambda m=m: unsplit(m)}
        mems: dict[str, list[int]] = {}
        for sched in ("gpipe", "1f1b"):
            for ck in ("never", "except_last"):
                s = PipelineStrategy(K, m, schedule=sched, rematerialize=ck, balance=balance, devices="cpu")
                with s.scope():
                    torch.manual_seed(0)
                    pipe = s.pipeline(build(args.width, args.layers), loss_fn, verbose=False)

                def ours(pipe: Any = pipe, s: Any = s) -> None:
                    s.run(pipe.train_step, args=(x, y))
                    for p in pipe.parameters():
                        p.grad = None

                runners[f"{sched}/{ck}"] = ours
                mems[f"{sched}/{ck}"] = world.all_gather_object(our_memory(pipe, ours))
        s = PipelineStrategy(K, m, schedule="interleaved_1f1b", rematerialize="never",
                             balance=chunk_balance("mlp", args), devices="cpu")  # fmt: skip
        with s.scope():
            torch.manual_seed(0)
            pipe = s.pipeline(build(args.width, args.layers), loss_fn, verbose=False)

        def interleaved(pipe: Any = pipe, s: Any = s) -> None:
            s.run(pipe.train_step, args=(x, y))
            for p in pipe.parameters():
                p.grad = None

        runners["interleaved/never"] = interleaved
        for name in ("GPipe", "1F1B", "Interleaved"):
            if name == "1F1B" and m < K:
                continue  # torch's Schedule1F1B needs M >= K
            bal = chunk_balance("mlp", args) if name == "Interleaved" else balance
            step, part = torch_pipelining(name, m, args, bal, x, y, loss_fn, rank)
            runners[f"torch {name}"] = step
            step()  # torch infers the shapes in the first step
            meter = ActivationMeter(list(part.parameters()))
            with meter.hooks():
                step()
            mems[f"torch {name}"] = world.all_gather_object(meter.peak)
        # interleaved rounds: every runner sees the same machine load; best and median kept
        walls: dict[str, list[float]] = {k: [] for k in runners}
        cpus: dict[str, list[float]] = {k: [] for k in runners}
        for r in range(args.rounds + 1):
            for key, fn in runners.items():
                world.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if r:
                    walls[key].append(wall)
                    cpus[key].append(cpu)
        all_cpu = world.all_gather_object({k: statistics.median(v) for k, v in cpus.items()})
        row: dict[str, Any] = {"M": m, "mem": mems}
        for key in runners:
            row[key] = (min(walls[key]), statistics.median(walls[key]))
            row["cpu " + key] = sum(c[key] for c in all_cpu)
        row["T1"] = world.broadcast_object(row["T1"], src=0)
        row["T1'"] = world.broadcast_object(row["T1'"], src=0)
        rows.append(row)
        if rank == 0:
            print(f"done M={m}", flush=True)
    if rank == 0:
        report(rows, args)


def our_memory(pipe: Any, step: Any) -> int:
    """Peak activation bytes of one step of ``pipe``'s stage (saved tensors + kept inputs)."""
    meter = ActivationMeter(list(pipe.parameters()))
    stage = pipe.stage

    def kept() -> int:  # inputs kept for recomputation (stage 0's are views of the batch: free)
        return sum(
            v.input.numel() * v.input.element_size()
            for v in stage._saved.values()
            if v.output is None and isinstance(v.input, torch.Tensor) and stage.index > 0
        )

    meter.extra = kept
    fwd = stage.forward

    def fwd_hook(*a: Any, **kw: Any) -> Any:
        out = fwd(*a, **kw)
        meter.sample()
        return out

    stage.forward = fwd_hook
    try:
        with meter.hooks():
            step()
    finally:
        stage.forward = fwd
    return meter.peak


def torch_pipelining(
    name: str, m: int, args: Any, balance: list[int], x: Any, y: Any, loss_fn: Any, rank: int
) -> tuple[Any, nn.Module]:
    """One step of torch.distributed.pipelining's schedule on the same split, and the stage."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    torch.manual_seed(0)
    model = build(args.width, args.layers) if args.shape == "mlp" else build_shape(args.shape)[0]
    layers = list(model)
    if name == "Interleaved":  # balance counts the layers of each of the K x V chunks
        chunks = [rank + j * K for j in range(len(balance) // K)]
    else:
        chunks = [rank]
    parts = []
    stages = []
    for c in chunks:
        start = sum(balance[:c])
        parts.append(nn.Sequential(*layers[start : start + balance[c]]))
        # shapes inferred in the first step
        stages.append(PipelineStage(parts[-1], c, len(balance), torch.device("cpu")))
    part = nn.ModuleList(parts)
    sched: Any
    if name == "Interleaved":
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    elif name == "ZB":
        sched = ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss_fn)
    else:
        sched = (ScheduleGPipe if name == "GPipe" else Schedule1F1B)(stages[0], m, loss_fn=loss_fn)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        for p in part.parameters():
            p.grad = None

    return step, part


def report(rows: list[dict[str, Any]], args: Any) -> None:
    mib = 1024 * 1024
    t1 = rows[0]["T1"][0]
    print(
        f"\n2-stage MLP: {args.layers} x [Linear({args.width}, {args.width}), ReLU] + Linear, batch "
        f"{args.batch}, 2 processes x 1 thread; {args.rounds} interleaved rounds per M"
    )
    print(f"unsplit model fwd+bwd on 1 thread: T1 = {t1 * 1e3:.1f} ms (best round)")
    print("ms per mini-batch: best round (median); eff = ideal / best")
    print("  ideal = T1 (M+K-1)/(MK) (the bubble formula); ideal' = the same with T1' = the unsplit")
    print("  model run micro-batch by micro-batch (adds the cost of smaller matrices)")
    hdr = [f"{'M':>3}", f"{'ideal':>6}", f"{'ideal2':>6}", "|", f"{'stratagem gpipe':>15}",
           f"{'eff':>5}", f"{'eff2':>5}", "|", f"{'torch GPipe':>15}", f"{'t/ours':>6}", "|",
           f"{'stratagem 1f1b':>15}", f"{'torch 1F1B':>15}", f"{'t/ours':>6}"]  # fmt: skip
    print(" ".join(hdr).replace("ideal2", "ideal'").replace(" eff2", " eff'"))

    def cell(v: Any) -> str:
        return (f"{v[0] * 1e3:.1f} ({v[1] * 1e3:.0f})" if v else "-").rjust(15)

    for r in rows:
        m = r["M"]
        ideal = t1 * (m + K - 1) / (m * K)
        ideal2 = r["T1'"][0] * (m + K - 1) / (m * K)
        g, f = r["gpipe/never"], r["1f1b/never"]
        tg, tf = r.get("torch GPipe"), r.get("torch 1F1B")
        ratio_f = f"{tf[0] / f[0]:>6.2f}" if tf else f"{'-':>6}"
        print(
            f"{m:>3} {ideal * 1e3:>6.1f} {ideal2 * 1e3:>6.1f} | {cell(g)} {ideal / g[0]:>5.2f} "
            f"{ideal2 / g[0]:>5.2f} | {cell(tg)} {tg[0] / g[0]:>6.2f} | {cell(f)} {cell(tf)} {ratio_f}"
        )
    print("  t/ours = torch's best time / ours, same schedule and memory (no re-materialization);")
    print("  > 1: stratagem is faster")
    print(f"\ninterleaved 1F1B (2 chunks per stage, layers per chunk {chunk_balance('mlp', args)}): best ms "
          "(median), vs torch's ScheduleInterleaved1F1B on the same chunks, and ideal / ours")  # fmt: skip
    for r in rows:
        ours, theirs = r["interleaved/never"], r.get("torch Interleaved")
        ideal = t1 * (r["M"] + K - 1) / (r["M"] * K)
        vs = f"t/ours {theirs[0] / ours[0]:.2f}" if theirs else "-"
        print(f"  M={r['M']:>2}: ours {cell(ours)}  torch {cell(theirs)}  {vs}  eff {ideal / ours[0]:.2f}")
    print("\nre-materialization (rematerialize='except_last'): best ms, and x time without it")
    for r in rows:
        a, b = r["gpipe/except_last"], r["1f1b/except_last"]
        print(
            f"  M={r['M']:>2}: gpipe {a[0] * 1e3:6.1f} (x{a[0] / r['gpipe/never'][0]:.2f})   "
            f"1f1b {b[0] * 1e3:6.1f} (x{b[0] / r['1f1b/never'][0]:.2f})"
        )
    print("\nCPU ms per mini-batch summed over both stages (all threads, median round)")
    for r in rows:
        a, b = r["cpu gpipe/never"], r.get("cpu torch GPipe", 0.0)
        print(
            f"  M={r['M']:>2}: stratagem GPipe {a * 1e3:6.1f}, torch ScheduleGPipe {b * 1e3:6.1f} "
            f"(torch/ours {b / a:.2f}); unsplit T1 {r['cpu T1'] * 1e3:.1f}"
        )
    print(
        f"  load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other "
        "processes on this machine make absolute times noisy)"
    )
    print("\npeak activation memory held for backward, MiB [stage 0, stage 1]")
    print("(autograd-saved tensors + inputs kept for recomputation)")
    keys = ["gpipe/never", "gpipe/except_last", "1f1b/never", "1f1b/except_last",
            "torch GPipe", "torch 1F1B"]  # fmt: skip
    print(f"{'M':>3} | " + " ".join(f"{k:>17}" for k in keys))
    for r in rows:
        cells = []
        for k in keys:
            v = r["mem"].get(k)
            cells.append(("[" + ", ".join(f"{b / mib:.1f}" for b in v) + "]") if v else "-")
        print(f"{r['M']:>3} | " + " ".join(f"{c:>17}" for c in cells))


if __name__ == "__main__":
    main()
