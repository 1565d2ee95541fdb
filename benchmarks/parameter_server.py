"""ParameterServerStrategy against MirroredStrategy on a recommendation-style model, in one run.

The model: an ``nn.Embedding`` table (VOCAB x 32), 8 ids per example mean-pooled, then an MLP
32-64-1; the binary target is a fixed random rule (the sign of the summed per-id weights).
Each shape trains twice, each run started by this script as its own job:

- ParameterServerStrategy, 2 workers + 1 ps (``stratagem run --workers 2 --ps 1``), the table
  split by ``MinSizePartitioner`` (the MLP whole), plain SGD (sparse row updates). Each step is
  one batch on one worker, so examples/s = steps x batch / time. Bytes moved per step: what the
  ps task received plus sent (``strategy.extended.traffic()``), divided by the steps.
- MirroredStrategy("cpu", num_replicas=2) (``stratagem run -n 2``), the table a dense
  ``nn.Embedding`` (sparse=False, as a user would write it), SGD. Each step is one batch per
  replica (global batch 2 x batch). Bytes per step: the gradient bytes all-reduced, computed from
  the parameter count (4 bytes each); in a ring each replica sends and receives ~2x that.

Shapes: 1,000,000 x 32 (the issue's), 100,000 x 32 and 10,000 x 32: the PS traffic stays at the
touched rows while the all-reduced bytes shrink with the table. Runs are
short (200 PS steps; 200 Mirrored ones, 20 on the 1M table) with one thread per process: a 2-core
machine runs 4 PS processes or 2 Mirrored ones. Run: ``python benchmarks/parameter_server.py``
(``--vocab 1000000 100000 10000 --batch 256 --ps-steps 200``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from torch import nn

import stratagem as sg

DIM, IDS, HIDDEN = 32, 8, 64


class Recommender(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, DIM)  # sparse=False: the gradient is a dense table
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).mean(1)).squeeze(1)


def batches(vocab: int, batch: int, seed: int):
    """Endless (ids, label) batches; the rule (a fixed random weight per id) is the same everywhere."""
    rule = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (batch, IDS), generator=g)
        yield ids, (rule[ids].sum(1) > 0).float()


def run_ps(args: argparse.Namespace) -> None:
    partitioner = sg.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
    strategy = sg.ParameterServerStrategy(variable_partitioner=partitioner)
    torch.set_num_threads(1)  # from here on only the chief runs
    torch.manual_seed(0)
    with strategy.scope():
        model = Recommender(args.vocab)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    coordinator = sg.coordinator.ClusterCoordinator(strategy)
    vocab, batch = args.vocab, args.batch

    def dataset_fn(context):
        torch.set_num_threads(1)
        return batches(vocab, batch, seed=1 + context.input_pipeline_id)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step_fn(it):
        def replica_fn(ids, y):
            optimizer.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(model(ids), y)
            loss.backward()
            optimizer.step()
            return loss

        ids, y = next(it)
        return strategy.run(replica_fn, args=(ids, y))

    losses = [coordinator.schedule(step_fn, args=(iterator,)) for _ in range(args.warmup)]
    coordinator.join()
    before = strategy.extended.traffic()
    start = time.perf_counter()
    losses = [coordinator.schedule(step_fn, args=(iterator,)) for _ in range(args.steps)]
    coordinator.join()
    elapsed = time.perf_counter() - start
    after = strategy.extended.traffic()
    moved = sum((a_in - b_in) + (a_out - b_out) for (a_in, a_out), (b_in, b_out) in zip(after, before))
    assert all(torch.isfinite(v.fetch()) for v in losses)  # every step's result arrived
    report = {"examples_per_s": args.steps * batch / elapsed, "bytes_per_step": moved / args.steps}
    print("REPORT " + json.dumps(report), flush=True)


def run_mirrored(args: argparse.Namespace) -> None:
    strategy = sg.MirroredStrategy("cpu", num_replicas=2)
    torch.set_num_threads(1)
    n = strategy.num_replicas_in_sync
    data = batches(args.vocab, args.batch, seed=1 + strategy.extended.replica_id)
    torch.manual_seed(0)
    with strategy.scope():
        model = Recommender(args.vocab)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss(reduction="none")

    def step(ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = sg.compute_average_loss(loss_fn(model(ids), y), global_batch_size=args.batch * n)
        loss.backward()
        optimizer.step()
        return loss.detach()

    for _ in range(args.warmup):
        strategy.run(step, args=next(data))
    strategy.barrier()
    start = time.perf_counter()
    losses = [strategy.run(step, args=next(data)) for _ in range(args.steps)]
    strategy.barrier()
    elapsed = time.perf_counter() - start
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(torch.isfinite(v) for v in losses)
    if strategy.extended.should_checkpoint:
        report = {"examples_per_s": args.steps * args.batch * n / elapsed, "bytes_per_step": params}
        print("REPORT " + json.dumps(report), flush=True)


def launch(kind: str, vocab: int, steps: int, warmup: int, args: argparse.Namespace) -> dict:
    cluster = ["--workers", "2", "--ps", "1", "--grace-period", "20"] if kind == "ps" else ["-n", "2"]
    common = ["--vocab", str(vocab), "--batch", str(args.batch), "--steps", str(steps), "--warmup", str(warmup), "--lr", str(args.lr)]
    cmd = [sys.executable, "-m", "stratagem", "run", *cluster, __file__, "--role", kind, *common]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in r.stdout.splitlines() if line.startswith("REPORT ")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"the {kind} run (vocab {vocab}) failed (exit code {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1][len("REPORT ") :])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, nargs="+", default=[1_000_000, 100_000, 10_000])
    parser.add_argument("--batch", type=int, default=256, help="examples per step on each worker / replica")
    parser.add_argument("--ps-steps", type=int, default=200)
    parser.add_argument("--mirrored-steps", type=int, help="default: 20 for tables of 1M rows and more, else 200")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--role", choices=["ps", "mirrored"], help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        args.vocab = args.vocab[0]
        (run_ps if args.role == "ps" else run_mirrored)(args)
        return

    print(
        f"embedding VOCAB x {DIM}, {IDS} ids per example (mean-pooled), MLP {DIM}-{HIDDEN}-1, batch {args.batch} "
        f"per worker/replica; SGD; 1 thread per process on {os.cpu_count()} cores"
    )
    for vocab in args.vocab:
        short = f"{vocab // 1000}k" if vocab < 1_000_000 else f"{vocab // 1_000_000}m"
        ps = launch("ps", vocab, args.ps_steps, 20, args)
        m_steps = args.mirrored_steps or (20 if vocab >= 1_000_000 else 200)
        mirrored = launch("mirrored", vocab, m_steps, 3, args)
        for name, r, how in (
            ("ps", ps, f"2 workers + 1 ps, {args.ps_steps} steps; bytes: the ps task's in + out"),
            ("mirrored", mirrored, f"2 replicas, {m_steps} steps; bytes: the gradient all-reduced (parameter bytes)"),
        ):
            print(
                f"{vocab:>9,} x {DIM} {name:<8} {r['examples_per_s']:9.0f} examples/s "
                f"{r['bytes_per_step'] / 1e6:10.3f} MB/step   ({how})"
            )
        for name, r in (("ps", ps), ("mirrored", mirrored)):
            print(f"RESULT {name}_{short}_examples_per_s={r['examples_per_s']:.1f}")
            print(f"RESULT {name}_{short}_bytes_per_step={r['bytes_per_step']:.0f}")
        print(f"RESULT ps_over_mirrored_{short}={ps['examples_per_s'] / mirrored['examples_per_s']:.2f}")


if __name__ == "__main__":
    main()
