"""The cost model (docs/SCALE.md), calibrated here and checked against runs of 2-16 gloo processes.

1. ``--store``: a TCPStore's calls a second from 1 and 4 client processes (``cost_probe.store_rate``).
2. For each N of ``--ranks``: the plain collectives (all-reduce, all-gather in both forms,
   reduce-scatter, all-to-all) and a copy into a fresh buffer at a few sizes (the checks predict
   from these points, ``cost_model.MeasuredLink``; the table prints the line of a latency a hop and
   a bus bandwidth each fits, ``cost_model.fit_link``), timed in the same rounds as the
   library's exchanges of a 1.32 M-parameter MLP's gradient (5.3 MB; the MLP of
   ``benchmarks/determinism.py``): the default mode's buckets all-reduced and the deterministic
   mode's ``reduce_blocks`` (all-to-all of block sums, all-gather of finished slices). Printed:
   measured, predicted (the model's collectives and copies at the constants of that N), ratio.
3. ``--steps``: for each N, a training step by ``fit`` under MirroredStrategy, the deterministic
   mode (32-row pieces) and ShardedStrategy (FSDP2) against the same step's compute alone on all N
   processes at once (this machine has 2 cores: compute is measured at the N it runs at, not
   modelled). Predicted step = measured compute + the model's exchange + fit's own small
   collectives (counted) at the all-reduce's latency; nothing overlaps on 2 shared cores.
4. The predictions at 8, 64, 512 and 4,096 GPUs (published NCCL figures, ``cost_model.nccl_fabric``)
   for nanoGPT-124M and a 7B model under each strategy, as docs/SCALE.md's tables.

Run: ``python benchmarks/cost_model.py [--ranks 2 4 8] [--rounds 5] [--steps] [--store] [--predict]``
(``--all``: everything; ``--ranks 2 4 8 16`` adds 16 processes).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from stratagem.testing import cost_model as cm
from stratagem.testing import cost_probe as cp
from stratagem.testing import run_workers

#: the MLP of benchmarks/determinism.py: 256 -> 1024 -> 1024 -> 10, as one tensor a parameter
DET_MLP = [1024 * 256, 1024, 1024 * 1024, 1024, 10 * 1024, 10]
#: calibration sizes, float32 elements (16 KB to 16 MB)
SIZES = [4096, 65536, 262144, 1 << 20, 4 << 20]
#: the step checks' MLP: width 1024, 2 hidden layers (2.4 M parameters), global batch 128
STEP_MLP = {"width": 1024, "depth": 2, "global_batch": 128}


def gloo_fabric(n: int, collectives: dict[str, list[tuple[int, float]]]) -> cm.Fabric:
    """The constants of N gloo processes on this machine, from the calibration's points."""
    links: dict[str, cm.Link | cm.MeasuredLink] = {
        kind: cm.measured_link(kind, n, pts) for kind, pts in collectives.items() if kind != "copy"
    }
    pts = collectives["copy"]
    copy = cm.fit_link("broadcast", 2, pts)  # a copy: t = latency + bytes / bandwidth (1 hop, all bytes)
    return cm.Fabric(f"gloo, {n} processes, loopback, 2 cores", links, copy_bw=copy.busbw, source="measured here")


def _fmt_link(name: str, link: cm.Link | cm.MeasuredLink) -> str:
    return f"{name} {link.latency * 1e6:7.0f} us/hop {link.busbw / 1e9:6.2f} GB/s"


def calibration_table(n: int, fab: cm.Fabric, collectives: dict[str, list[tuple[int, float]]]) -> None:
    print(f"  N = {n}: " + "; ".join(_fmt_link(k, v) for k, v in fab.links.items()) + f"; copy {fab.copy_bw / 1e9:.2f} GB/s")
    worst = 0.0
    for kind, pts in collectives.items():
        if kind == "copy":
            continue
        line = cm.fit_link(kind, n, pts)
        for b, t in pts:
            worst = max(worst, abs(line.seconds(kind, b, n) / t - 1))
    print(f"    the line's worst point: {worst:.0%} off (sizes 16 KB-16 MB; the checks interpolate the points themselves)")


def exchange_check(ns: list[int], rounds: int) -> list[tuple[str, int, float, float]]:
    rows = []
    print("\n== the library's exchanges (5.3 MB of gradient), measured vs predicted, gloo on loopback")
    for n in ns:
        t0 = time.time()
        r = run_workers(cp.exchange_worker, n, args=(DET_MLP, SIZES, rounds, 5), timeout=900)[0].value
        fab = gloo_fabric(n, r["collectives"])
        calibration_table(n, fab, r["collectives"])
        default = cm.reducer_exchange(r["buckets"], n, flags=False).seconds(fab)
        det = cm.blocks_exchange([sum(DET_MLP) * 4], n, r["blocks"], r["all_blocks"], fresh=True).seconds(fab)
        for name, meas, pred in (("default (buckets all-reduced)", r["default"], default),
                                 ("deterministic (reduce_blocks)", r["deterministic"], det)):  # fmt: skip
            print(f"    {name:32} measured {meas * 1e3:8.2f} ms  predicted {pred * 1e3:8.2f} ms  ratio {pred / meas:5.2f}")
            rows.append((name, n, meas, pred))
        print(f"    ({time.time() - t0:.0f} s)", flush=True)
    return rows


def step_prediction(name: str, n: int, r: dict[str, Any], fab: cm.Fabric) -> tuple[float, float]:
    """(predicted exchange seconds, fit's other collectives' seconds) of one step of ``r``."""
    counts = r["collectives_per_step"]
    if name == "mirrored":
        ex = cm.reducer_exchange(r["buckets"], n)
        own = len(r["buckets"])
    elif name == "deterministic":
        pieces = STEP_MLP["global_batch"] // (32 * n)
        k, K = cm.deterministic_blocks(n, STEP_MLP["global_batch"], 32)
        ex = cm.blocks_exchange(r["buckets"], n, k, K, fresh=False)
        own = 2 * len(r["buckets"])
        del pieces
    else:
        ex = cm.fsdp_exchange(r["units"], n)
        own = 3 * len(r["units"])
    others = max(0.0, sum(counts.values()) - own)
    small = fab.seconds(cm.Collective("all_reduce", 64, n)) * others
    return ex.seconds(fab), small


def steps_check(ns: list[int], rounds: int) -> list[tuple[str, int, float, float]]:
    rows = []
    print("\n== a fit step (MLP 2.4 M parameters, AdamW, clipping, global batch 128), measured vs predicted")
    print("   predicted = compute (measured: the same step by plain torch on N processes at once) + the model's exchange")
    for n in ns:
        for name in ("mirrored", "deterministic", "sharded"):
            if name == "deterministic" and STEP_MLP["global_batch"] % (32 * n):
                continue
            t0 = time.time()
            r = run_workers(cp.step_worker, n, args=(name, STEP_MLP["width"], STEP_MLP["depth"], STEP_MLP["global_batch"],
                                                    8, rounds, SIZES[1:]), timeout=1200)[0].value  # fmt: skip
            fab = gloo_fabric(n, r["collectives"])
            ex, small = step_prediction(name, n, r, fab)
            pred = r["compute"] + ex + small
            comm_meas = r["step"] - r["compute"]
            counts = " ".join(f"{k} {v:g}" for k, v in sorted(r["collectives_per_step"].items()))
            print(f"  N = {n:2} {name:13} step measured {r['step'] * 1e3:7.1f} ms predicted {pred * 1e3:7.1f} "
                  f"(ratio {pred / r['step']:4.2f}); compute {r['compute'] * 1e3:6.1f}; "
                  f"exchange + fit's collectives measured {comm_meas * 1e3:6.1f} predicted {(ex + small) * 1e3:6.1f} "
                  f"(ratio {(ex + small) / comm_meas if comm_meas > 0 else math.nan:4.2f}); collectives a step: {counts} "
                  f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
            rows.append((name, n, r["step"], pred))
    return rows


def store_check() -> None:
    print("\n== the TCPStore")
    for clients in (1, 4):
        rate = cp.store_rate(clients, 3.0)
        print(f"  {clients} client process{'es' if clients > 1 else ''}: {rate:,.0f} calls/s"
              + (f"  (the control plane's 2N + 8 calls/s reach it at N = {(rate - 8) / 2:,.0f})" if clients > 1 else ""), flush=True)


# --- predictions --------------------------------------------------------------------------------

SCALES = (8, 64, 512, 4096)
#: nanoGPT's own run: 0.5 M tokens a step (512 x 1,024; nanoGPT's 491,520 rounded to split evenly),
#: 16-row micro-steps; Llama 2's 4 M tokens (1,024 x 4,096), one row a micro-step
WORKLOADS = (
    (cm.NANOGPT_124M, 512, {"tensor": 4, "stages": 4, "micro_rows": 16, "piece": 1}),
    (cm.LLAMA_7B, 1024, {"tensor": 8, "stages": 8, "micro_rows": 1, "piece": 1}),
)


def prediction(strategy: str, n: int, model: cm.Model, batch: int, opts: dict[str, Any], fabric: cm.Fabric,
               chip: dict[str, float], mfu: float) -> str:  # fmt: skip
    """One cell: step time, efficiency, and what breaks first."""
    kw = dict(opts)
    kw.setdefault("ps_tasks", max(1, n // 8))
    try:
        c = cm.costs(strategy, n, model.params, batch, model=model, tokens_per_row=model.seq, gather_bytes=2, **kw)
    except ValueError as e:
        return f"refused: {str(e).split(':', 1)[-1].strip()}"
    p = cm.predict(c, fabric, model, flops=chip["flops"], mfu=mfu, hbm=chip["hbm"])
    lim = f"; {p.limits[0]}" if p.limits else ""
    return f"{p.step * 1e3:,.0f} ms, {p.efficiency:.0%}, {c.memory_per_rank / 1e9:.0f} GB{lim}"


def predictions(mfu: float = 0.4) -> None:
    fabric = cm.nccl_fabric()
    print(f"\n== predictions: H100 SXM (989 TFLOP/s bf16, {mfu:.0%} MFU, 80 GB), {fabric.source}")
    print("   each cell: step time, scaling efficiency (compute a perfectly scaling job spends / the step), memory a rank; what breaks first")
    for model, batch, opts in WORKLOADS:
        print(f"\n  {model.name}: global batch {batch} x {model.seq} tokens, {model.flops_per_token / 1e9:.2f} GFLOP a token")
        for strategy in cm.STRATEGIES:
            if strategy == "multiworker":
                continue
            # TPUStrategy on TPU v5p chips over ICI (published figures); every other strategy on H100s over NCCL
            fab, chip = (cm.tpu_fabric(), cm.TPU_V5P) if strategy == "tpu" else (fabric, cm.H100)
            cells = [prediction(strategy, n, model, batch, opts, fab, chip, mfu) for n in SCALES]
            print(f"  {strategy:13} | " + " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--exchanges", action="store_true", help="the exchange checks (the default when nothing else is asked)")
    parser.add_argument("--steps", action="store_true", help="the step checks")
    parser.add_argument("--store", action="store_true", help="the TCPStore's calls a second")
    parser.add_argument("--predict", action="store_true", help="the predictions at 8-4,096 GPUs")
    parser.add_argument("--all", action="store_true")
    args = parser.parse_args()
    if not (args.exchanges or args.steps or args.store or args.predict):
        args.exchanges = True
    if args.all:
        args.exchanges = args.steps = args.store = args.predict = True
    print(f"python {' '.join(sys.argv)}", flush=True)
    if args.store:
        store_check()
    if args.exchanges:
        exchange_check(args.ranks, args.rounds)
    if args.steps:
        steps_check(args.ranks, max(3, args.rounds // 2))
    if args.predict:
        predictions()


if __name__ == "__main__":
    main()
