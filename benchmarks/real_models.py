"""A nanoGPT-sized GPT under each strategy against what a user writes by hand with torch, in one run.

nanoGPT's ``model.py`` as published (``tests/real_models/nanogpt_model.py``), its shakespeare-char
size: 6 layers, width 384, 6 heads, sequence 256, vocabulary 65 (10.7 M parameters, the token
embedding tied to the output head), AdamW, global batch ``--batch`` sequences. Pairs, each timed
in the same job, alternating round by round so machine noise hits all alike (median tokens/s):

- MirroredStrategy (``strategy.run`` of a custom step) vs ``DistributedDataParallel``;
- ShardedStrategy vs ``fully_shard`` on every block and the root;
- PipelineStrategy (2 stages: embeddings + 3 blocks | 3 blocks + head, the tie across the stages,
  GPipe, ``--microbatches``, ``rematerialize="never"`` as torch's schedule does no recomputation) vs ``torch.distributed.pipelining`` (``PipelineStage`` +
  ``ScheduleGPipe`` on the same split, and the tied weight's gradient all-reduced by hand between
  the two stages, as a user of torch's pipelining must).

Run: ``torchrun --nproc-per-node 2 benchmarks/real_models.py [--rounds 3 --steps 2]`` (several
strategies in one script need a launcher). CPU, gloo, one thread per process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stratagem as sg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "real_models"))
from nanogpt_model import GPT, GPTConfig  # noqa: E402
from real_cases import stages_of, sum_tie, torch_gpipe  # noqa: E402

VOCAB, SEQ = 65, 256


def gpt() -> nn.Module:
    cfg = GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=6, n_head=6, n_embd=384, dropout=0.0, bias=False)
    with contextlib.redirect_stdout(io.StringIO()):  # nanoGPT prints its parameter count
        return GPT(cfg)


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def per_example(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8, help="global batch, sequences")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    mirrored = sg.MirroredStrategy(devices="cpu")
    sharded = sg.ShardedStrategy(devices="cpu")
    # no re-materialization: the same work as torch's schedule (the default, "except_last",
    # recomputes all but the last micro-batch's forward to hold fewer activations)
    piped = sg.PipelineStrategy(num_stages=2, num_microbatches=args.microbatches, balance=[4, 4], rematerialize="never")
    rank, n = dist.get_rank(), dist.get_world_size()
    chief = rank == 0
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (args.batch, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (args.batch, SEQ), generator=g)
    mine = slice(rank * args.batch // n, (rank + 1) * args.batch // n)
    xl, yl = x[mine], y[mine]  # this process's share (data parallel)

    steps: dict[str, Callable[[], None]] = {}

    # --- data parallel: ours, and DDP ---------------------------------------------------------
    def strategy_step(strategy: sg.Strategy) -> Callable[[], None]:
        torch.manual_seed(0)
        with strategy.scope():
            model = gpt()
            opt = adamw(model.parameters())

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            sg.compute_average_loss(per_example(model(x, y)[0], y), global_batch_size=args.batch).backward()
            opt.step()

        return lambda: strategy.run(step, args=(xl, yl))

    steps["MirroredStrategy"] = strategy_step(mirrored)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(gpt())
    ddp_opt = adamw(ddp.parameters())

    def ddp_step() -> None:
        ddp_opt.zero_grad()
        token_loss(ddp(xl, yl)[0], yl).backward()
        ddp_opt.step()

    steps["DDP"] = ddp_step

    # --- sharded: ours, and fully_shard ---------------------------------------------------------
    steps["ShardedStrategy"] = strategy_step(sharded)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    hand = gpt()
    for block in hand.transformer.h:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(hand)
    for m in hand.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no AVG
    hand_opt = adamw(hand.parameters())

    def fsdp_step() -> None:
        hand_opt.zero_grad()
        token_loss(hand(xl, yl)[0], yl).backward()
        hand_opt.step()

    steps["fully_shard"] = fsdp_step

    # --- pipeline: ours, and torch.distributed.pipelining ----------------------------------------
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        pipe = piped.pipeline(stages_of("nanogpt", gpt()), token_loss, loss_reduction="mean")
    with piped.scope():
        pipe_opt = adamw(pipe.parameters())

    def pipe_step() -> None:
        piped.run(pipe.train_step, args=(x, y))
        pipe_opt.step()
        pipe_opt.zero_grad()

    steps["PipelineStrategy"] = pipe_step
    torch.manual_seed(0)
    part, tied, schedule = torch_gpipe(gpt(), rank, args.microbatches, token_loss)
    torch_opt = adamw(part.parameters())

    def torch_pipe_step() -> None:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        sum_tie(tied)
        torch_opt.step()
        torch_opt.zero_grad()

    steps["torch pipelining"] = torch_pipe_step

    def timed(step: Callable[[], None]) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        dist.barrier()
        return args.batch * SEQ * args.steps / (time.perf_counter() - start)

    params = sum(p.numel() for p in gpt().parameters())
    if chief:
        print(f"nanoGPT {params / 1e6:.1f} M parameters (6 layers, width 384, seq {SEQ}), global batch "
              f"{args.batch} x {SEQ} tokens, AdamW, {n} processes (gloo, 1 thread each), "
              f"{args.rounds} rounds x {args.steps} steps", flush=True)  # fmt: skip
    runs: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(args.rounds):
        for name, step in steps.items():
            runs[name].append(timed(step))
    med = {name: statistics.median(v) for name, v in runs.items()}
    if chief:
        for name, v in runs.items():
            print(f"{name:18s} {med[name]:8.0f} tokens/s  (rounds: {', '.join(f'{r:.0f}' for r in v)})")
        for ours, theirs in (("MirroredStrategy", "DDP"), ("ShardedStrategy", "fully_shard"),
                             ("PipelineStrategy", "torch pipelining")):  # fmt: skip
            paired = statistics.median(a / b for a, b in zip(runs[ours], runs[theirs]))
            print(f"ratio {ours} / {theirs}: {med[ours] / med[theirs]:.3f} of the medians, "
                  f"{paired:.3f} median of the rounds' ratios (each pair runs back to back)")


if __name__ == "__main__":
    main()
