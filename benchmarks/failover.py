"""Losing a replica under ``FailureOptions(on_failure="continue")``: what it costs, and what it does not.

nanoGPT (``model.py`` as published, a small configuration: 4 layers, width 128, 64 tokens,
dropout 0.1), AdamW from its ``configure_optimizers``, global clipping at 1.0, trained by
``sg.fit`` under ``MirroredStrategy(3)`` (a plain ``python`` starts the other replicas itself),
global batches of 24 sequences, in the deterministic mode (``enable_op_determinism(piece_size=8)``).

1. **Overhead when nothing fails**: one job, four fit set-ups in alternating rounds: plain
   Mirrored, Mirrored with ``on_failure="continue"``, and both in the deterministic mode. Median
   step time of each; ratios to plain Mirrored.
2. **Trials**: ``--trials`` jobs, each killing a random replica (1 or 2: replica 0 hosts the job's
   store) with SIGKILL at a random moment of a random step (a timer started at that step's
   beginning, a random fraction of the step time), ``max_restarts=1``, so the killed replica is
   started again and comes back from a live peer. Each trial's final parameters' SHA-256 is
   compared with the run in which nothing failed; the time lost per failure is measured from the
   interrupted step's start to the commit of its retry (the survivors' agreeing and regrouping
   alone: "round"), against the step time; the rejoin's transfer (bytes, seconds) against a
   memcpy of the same number of bytes in the same process.

Run: ``python benchmarks/failover.py [--trials 20] [--steps 48] [--rounds 3]``. CPU, gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

import stratagem as sg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "real_models"))
from nanogpt_model import GPT, GPTConfig  # noqa: E402

VOCAB, SEQ, BATCH = 65, 64, 24


def _model() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=128, dropout=0.1, bias=False)
    with contextlib.redirect_stdout(io.StringIO()):  # nanoGPT prints its parameter count
        return GPT(cfg)


def _model_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """nanoGPT's own loss (its forward computes it from ``targets``), as train.py trains it."""
    return out[1]  # type: ignore[no-any-return]


def _data(steps: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        idx, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        out.append(({"idx": idx, "targets": targets}, targets))
    return out


def _fit(strategy: sg.Strategy, steps: int, callbacks: list[Any] | None = None) -> tuple[torch.nn.Module, float]:
    with strategy.scope():
        model = _model()
        with contextlib.redirect_stdout(io.StringIO()):  # configure_optimizers prints its groups
            opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.99), device_type="cpu")
    start = time.perf_counter()
    sg.fit(model, opt, _model_loss, _data(steps), epochs=1, global_clipnorm=1.0, strategy=strategy, verbose=0,
           callbacks=callbacks or [])  # fmt: skip
    return model, (time.perf_counter() - start) / steps


def _hash(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters())).hexdigest()


# --- one job's program (every replica runs it) ------------------------------------------------------
def overhead_job(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    cont = sg.MirroredStrategy(devices="cpu", num_replicas=3, failure=sg.FailureOptions(on_failure="continue"))
    plain = sg.MirroredStrategy(devices="cpu", num_replicas=3)
    sides = {"Mirrored": (plain, False), "Mirrored + continue": (cont, False),
             "Mirrored, deterministic": (plain, True), "Mirrored + continue, deterministic": (cont, True)}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.rounds + 1):  # the first round warms up
        order = list(sides.items()) if r % 2 == 0 else list(reversed(sides.items()))
        for name, (strategy, det) in order:
            if det:
                sg.experimental.enable_op_determinism(piece_size=8)
            _, step = _fit(strategy, args.steps)
            sg.experimental.disable_op_determinism()
            if r:
                times[name].append(step)
    if cont.extended.replica_id == 0:
        print(json.dumps({"overhead": times}), flush=True)


class _KillAt(sg.Callback):
    """SIGKILL this process at a random moment of step ``step`` (a fraction ``frac`` of the
    median step time so far, from the step's start)."""

    def __init__(self, step: int, frac: float) -> None:
        self.step, self.frac = step, frac
        self.began: float | None = None
        self.times: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        now = time.perf_counter()
        if self.began is not None:
            self.times.append(now - self.began)
        self.began = now
        if batch == self.step:
            delay = self.frac * statistics.median(self.times)
            threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()


def trial_job(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    options = sg.FailureOptions(on_failure="continue", max_restarts=1 if args.victim > 0 else 0)
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=3, failure=options)
    sg.experimental.enable_op_determinism(piece_size=8)
    rank = int(os.environ.get("RANK", "0"))
    again = os.environ.get("STRATAGEM_REPLACEMENT") == "1"
    cbs = [_KillAt(args.at_step, args.frac)] if rank == args.victim and not again else []
    start = time.perf_counter()
    model, step = _fit(strategy, args.steps, cbs)
    total = time.perf_counter() - start
    from stratagem.train.failover import FIGURES

    record = {"rank": rank, "again": again, "hash": _hash(model), "step_s": step, "total_s": total,
              "replicas": strategy.num_replicas_in_sync, "figures": FIGURES}  # fmt: skip
    rejoin = [f for f in FIGURES if f["event"] == "rejoin"]
    if rejoin:  # a memcpy of the same bytes, in this process
        n = int(rejoin[-1]["bytes"])
        src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        src.fill_(1)
        t = time.perf_counter()
        dst.copy_(src)
        record["memcpy_s"] = time.perf_counter() - t
    Path(args.out, f"rank{rank}{'-again' if again else ''}.json").write_text(json.dumps(record))


# --- the driver ---------------------------------------------------------------------------------
def _job(args: list[str], timeout: float = 600) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="stratagem-failover-") as out:
        done = subprocess.run([sys.executable, __file__, *args, "--out", out], capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"job {args} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return [json.loads(f.read_text()) for f in sorted(Path(out).iterdir())]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--job", choices=["overhead", "trial"], default=None)
    parser.add_argument("--victim", type=int, default=-1)
    parser.add_argument("--at-step", type=int, default=0)
    parser.add_argument("--frac", type=float, default=0.5)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if args.job == "overhead":
        return overhead_job(args)
    if args.job == "trial":
        return trial_job(args)

    print(f"nanoGPT (4 layers, width 128, {SEQ} tokens, dropout 0.1), AdamW, clip 1.0, global batch {BATCH}, "
          f"3 CPU replicas (gloo, 1 thread each), {args.steps} steps per fit", flush=True)  # fmt: skip
    out = subprocess.run([sys.executable, __file__, "--job", "overhead", "--steps", str(args.steps),
                          "--rounds", str(args.rounds)], capture_output=True, text=True, timeout=1200)  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    times = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))["overhead"]
    base = statistics.median(times["Mirrored"])
    for name, v in times.items():
        print(f"{name:38s} {1000 * statistics.median(v):7.1f} ms/step  {statistics.median(v) / base:5.3f}x Mirrored "
              f"(rounds: {', '.join(f'{1000 * x:.1f}' for x in v)})", flush=True)  # fmt: skip

    reference = _job(["--job", "trial", "--steps", str(args.steps)])
    want = reference[0]["hash"]
    step_s = reference[0]["step_s"]
    print(f"no failure: {step_s * 1000:.1f} ms/step, hash {want[:16]}", flush=True)
    rng = random.Random(args.seed)
    same, lost, rounds, rejoins = 0, [], [], []
    for t in range(args.trials):
        victim, at, frac = rng.choice([1, 2]), rng.randrange(2, args.steps // 3), rng.random()
        results = _job(["--job", "trial", "--steps", str(args.steps), "--victim", str(victim),
                        "--at-step", str(at), "--frac", f"{frac:.3f}"])  # fmt: skip
        ok = len(results) == 3 and all(r["hash"] == want for r in results)
        same += ok
        chief = next(r for r in results if r["rank"] == 0)
        events = chief["figures"]
        for e in events:
            if e["event"] == "lost":
                lost.append(e["lost_s"])
                rounds.append(e["round_s"])
            else:
                rejoins.append((e["bytes"], e["seconds"], chief.get("memcpy_s")))
        back = [r for r in results if r["again"]]
        costs = ", ".join(f"{e['lost_s']:.2f}s (round {e['round_s']:.2f}s)" for e in events if e["event"] == "lost")
        print(f"trial {t + 1:2d}: replica {victim} killed in step {at} at {frac:.2f} of it; "
              f"{'same hash' if ok else 'DIFFERENT HASH'}; came back: {bool(back)}; lost {costs}", flush=True)  # fmt: skip
    print(f"{same}/{args.trials} trials end with the fault-free hash")
    if lost:
        print(f"time lost per failure: median {statistics.median(lost):.2f}s, max {max(lost):.2f}s "
              f"(= the survivors' round, median {statistics.median(rounds):.2f}s, + the interrupted step "
              f"again, one step = {step_s:.2f}s)")  # fmt: skip
    if rejoins:
        rate = [b / s / 1e6 for b, s, _ in rejoins]
        mem = [b / m / 1e6 for b, _, m in rejoins if m]
        print(f"rejoin: {statistics.median([b for b, _, _ in rejoins]) / 1e6:.1f} MB from a live peer at "
              f"median {statistics.median(rate):.0f} MB/s (memcpy of the same bytes: {statistics.median(mem):.0f} MB/s)")  # fmt: skip


if __name__ == "__main__":
    main()
