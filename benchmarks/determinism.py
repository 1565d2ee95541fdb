"""The deterministic mode's cost: fit under MirroredStrategy with and without
``stratagem.experimental.enable_op_determinism``, in one run.

The same model, data (global batches already in memory), optimizer (AdamW) and global clipping;
rounds alternate the two modes so machine noise hits both alike; steps/s is the median over
rounds; the ratio is default / deterministic time per step (the issue's target: the mode costs at
most 1.25x). On a shared machine the quartiles of single steps' times (printed after) are the
steadier comparison. Every process prints nothing but rank 0's lines.
Run: ``python benchmarks/determinism.py [--replicas 2] [--model mlp|gpt] [--piece 32]``
(a plain ``python`` starts the other replicas itself).

``--bytes``: also the bytes each mode sends per update and replica, read from the loopback
interface's transmit counter around each round (every replica and the store on this machine):
run the job in a network namespace of its own, where nothing else uses that interface, as root:
``unshare -n sh -c 'ip link set lo up; python benchmarks/determinism.py --bytes'``. The count is
everything on the wire: the gradient exchange, fit's other collectives, the store's control
traffic, TCP/IP headers and acknowledgements.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

import stratagem as sg


def mlp() -> tuple[nn.Module, tuple[int, ...], int]:
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 1024), nn.GELU(),
                         nn.Linear(1024, 10)), (256,), 10  # fmt: skip


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A 4-block, width-128 causal-free transformer over 64 tokens, classifying each sequence."""

    def __init__(self, vocab: int = 512, d: int = 128, t: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.blocks = nn.Sequential(*(Block(d) for _ in range(4)))
        self.head = nn.Linear(d, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.blocks(x).mean(dim=1))


def model_of(name: str) -> nn.Module:
    return mlp()[0] if name == "mlp" else TinyGPT()


def loopback_sent() -> int:
    """Bytes sent so far on this network namespace's loopback interface (Linux)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/self/net/dev")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default="mlp", choices=["mlp", "gpt"])
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--piece", type=int, default=32, help="rows per piece in the deterministic mode")
    p.add_argument("--steps", type=int, default=20, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bytes", action="store_true", help="bytes sent per update (run in a network namespace of its own)")
    args = p.parse_args()
    if args.bytes and not os.path.exists("/proc/self/net/dev"):
        p.error("--bytes reads /proc/self/net/dev (Linux)")
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=args.replicas)
    chief = strategy.extended.should_log
    g = torch.Generator().manual_seed(0)
    if args.model == "mlp":
        batches = [(torch.randn(args.batch, 256, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
                   for _ in range(args.steps)]  # fmt: skip
    else:
        batches = [(torch.randint(0, 512, (args.batch, 64), generator=g), torch.randint(0, 10, (args.batch,), generator=g))
                   for _ in range(args.steps)]  # fmt: skip

    sent: dict[bool, list[float]] = {False: [], True: []}
    steps: dict[bool, list[float]] = {False: [], True: []}  # every step's seconds but each round's first

    class StepTimes(sg.Callback):
        may_stop_per_batch = False  # it never stops training: fit need not agree after each batch

        def __init__(self, into: list[float]) -> None:
            self.into, self.last = into, None

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            now = time.perf_counter()
            if self.last is not None:
                self.into.append(now - self.last)
            self.last = now

    def one_round(deterministic: bool) -> float:
        if deterministic:
            sg.experimental.enable_op_determinism(piece_size=args.piece)
        gc.collect()  # the last round's model, if a cycle holds it, leaves the scope's reduction now
        torch.manual_seed(0)
        with strategy.scope():
            model = model_of(args.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = loopback_sent() if args.bytes else 0
        t0 = time.perf_counter()
        sg.fit(model, opt, nn.CrossEntropyLoss(), batches, global_clipnorm=1.0, strategy=strategy, verbose=0,
               callbacks=[StepTimes(steps[deterministic])])  # fmt: skip
        seconds = time.perf_counter() - t0
        if args.bytes:  # every replica's sends, this round: per update and replica
            sent[deterministic].append((loopback_sent() - before) / args.steps / args.replicas)
        if deterministic:
            sg.experimental.disable_op_determinism()
        return args.steps / seconds

    one_round(False), one_round(True)  # warm up
    steps[False].clear(), steps[True].clear()
    plain, det = [], []
    for _ in range(args.rounds):
        plain.append(one_round(False))
        det.append(one_round(True))
    a, b = statistics.median(plain), statistics.median(det)
    if chief:
        print(f"fit under MirroredStrategy({args.replicas}), {args.model}, global batch {args.batch}, "
              f"piece {args.piece}, {args.rounds} rounds of {args.steps} steps")  # fmt: skip
        print(f"  default       {a:8.2f} steps/s")
        print(f"  deterministic {b:8.2f} steps/s")
        print(f"  cost: {a / b:.2f}x the default step (target <= 1.25x)")
        # a step's time, quartiles over every round's steps: the lower ones are the least touched
        # by other work on the machine (its median, above, takes whole rounds)
        q = {d: statistics.quantiles(t, n=4) for d, t in steps.items()}
        print("  step time, ms (25th / 50th percentile): default "
              f"{q[False][0] * 1e3:.1f} / {q[False][1] * 1e3:.1f}, deterministic {q[True][0] * 1e3:.1f} / "
              f"{q[True][1] * 1e3:.1f}: {q[True][0] / q[False][0]:.2f}x / {q[True][1] / q[False][1]:.2f}x")  # fmt: skip
        if args.bytes:
            # the warm-up round is left out: its first steps carry the start-up's traffic
            x, y = statistics.median(sent[False][1:]), statistics.median(sent[True][1:])
            params = sum(q.numel() * q.element_size() for q in model_of(args.model).parameters())
            print(f"  sent per update and replica (loopback, all traffic; gradient {params / 1e6:.2f} MB):")
            print(f"    default       {x / 1e6:8.2f} MB")
            print(f"    deterministic {y / 1e6:8.2f} MB  ({y / x:.2f}x the default, target <= 1.25x)")


if __name__ == "__main__":
    main()
