"""nanoGPT (or Hugging Face's GPT-2) trained by ``sg.fit`` against nanoGPT's own ``train.py`` loop, in one run.

nanoGPT's ``model.py`` as published (``tests/real_models/nanogpt_model.py``; ``--model gpt2``:
``transformers``' ``GPT2LMHeadModel`` of the same size, its own loss from ``labels``), trained as its
``train.py`` trains it: AdamW from the model's own ``configure_optimizers`` (weight decay on
matrices only), gradient accumulation (``--accumulate`` micro-steps per update), global-norm
clipping at 1.0, and a learning rate set every iteration (linear warm-up, then cosine decay:
``train.py``'s ``get_lr``). Pairs, each timed in the same job, alternating round by round so
machine noise hits both alike:

- ``MirroredStrategy`` + ``sg.fit(..., gradient_accumulation_steps=, global_clipnorm=1.0,
  lr_scheduler=LambdaLR(get_lr), lr_scheduler_interval="step")`` against ``train.py``'s DDP loop
  (``require_backward_grad_sync`` off on every micro-step but the last, ``clip_grad_norm_``);
- ``ShardedStrategy`` + the same ``fit`` call against the same loop over FSDP2 (``fully_shard``
  per block and the root, ``set_requires_gradient_sync(False)`` on every micro-step but the last);
- nanoGPT only, ``PipelineStrategy`` (2 stages: embeddings + 3 blocks | 3 blocks + head, the tie
  across them, GPipe, ``--microbatches``, the default ``rematerialize="auto"``) + ``fit(...,
  global_clipnorm=1.0, lr_scheduler=...)`` against the same split under
  ``torch.distributed.pipelining``'s ``ScheduleGPipe``, the tie's gradient all-reduced and the
  global norm taken across the stages by hand. A pipeline accumulates over its micro-batches, so
  both sides take each update's micro-steps as one mini-batch (``--accumulate`` x ``--batch``).

Both sides train from the same initial weights on the same batches; the script prints each
side's last loss and the largest parameter difference at the end (they must agree), then
tokens/s by medians and the median of the rounds' own ratios.

Run: ``torchrun --nproc-per-node 2 benchmarks/real_models_fit.py [--rounds 5 --updates 3]``
(``--layers/--width/--seq`` for other shapes). CPU, gloo, one thread per process.

On a GPU (``--device cuda``, the default when CUDA is visible: ``torchrun --nproc-per-node 1`` on
a one-GPU machine, NCCL), both sides run at ``--dtype bfloat16`` (the default there): ``fit(...,
precision="bf16")`` against train.py's loop under ``torch.autocast("cuda", torch.bfloat16)`` as
train.py writes it; the script then prints, per side, tokens/s and the MFU by nanoGPT's own
formula (``6N + 12 L H Q T`` FLOPs per token, model.py's ``estimate_mfu``) against the GPU's dense
bf16 peak (H100 / H200 989 TFLOPS, A100 312; another GPU: against A100's, said so). The pipeline
pair needs 2 processes and is skipped on one GPU. Timing synchronizes the device.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import stratagem as sg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "real_models"))
from nanogpt_model import GPT, GPTConfig  # noqa: E402

VOCAB = 65
LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-4, 4, 40  # train.py's shakespeare-char ratios, shortened


def get_lr(it: int) -> float:
    """nanoGPT train.py's ``get_lr``: linear warm-up, cosine decay, then ``min_lr``."""
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > DECAY:
        return MIN_LR
    ratio = (it - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def make_gpt(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    if args.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        hf = GPT2Config(vocab_size=VOCAB, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, use_cache=False)  # fmt: skip
        model = GPT2LMHeadModel(hf)
        model.loss_type = "ForCausalLM"  # named, so transformers does not print its guess
        return model
    cfg = GPTConfig(block_size=args.seq, vocab_size=VOCAB, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width, dropout=0.0, bias=False)  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):  # nanoGPT prints its parameter count
        return GPT(cfg)


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    if not isinstance(model, GPT):  # configure_optimizers' groups: decay on matrices only
        return _decay_groups(model.parameters())
    with contextlib.redirect_stdout(io.StringIO()):  # configure_optimizers prints its groups
        return model.configure_optimizers(weight_decay=0.1, learning_rate=LR, betas=(0.9, 0.99), device_type="cpu")  # type: ignore[no-any-return]


def model_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """nanoGPT's own loss (its forward computes it from ``targets``): the replica's mean. (GPT-2's,
    from ``labels``, is fit's ``loss_fn=None``: a model output's ``loss``.)"""
    return out[1]  # type: ignore[no-any-return]


def blocks_of(model: Any) -> Any:
    return model.transformer.h  # both name their blocks so


def forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, gpt2: bool) -> torch.Tensor:
    """One micro-step's loss, as each model's own training script computes it."""
    if gpt2:
        return model(input_ids=x, labels=y).loss  # type: ignore[no-any-return]
    return model(x, y)[1]  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8, help="global batch of one micro-step, sequences")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-steps per update")
    parser.add_argument("--updates", type=int, default=3, help="optimizer updates per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--only", choices=["mirrored", "sharded", "pipeline"], default=None)
    parser.add_argument("--microbatches", type=int, default=4, help="the pipeline pair's micro-batches")
    parser.add_argument("--model", choices=["nanogpt", "gpt2"], default="nanogpt")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    args = parser.parse_args()
    cuda = args.device == "cuda"
    bf16 = (args.dtype or ("bfloat16" if cuda else "float32")) == "bfloat16"
    if not cuda:
        torch.set_num_threads(1)
    sg.MirroredStrategy(devices=args.device)  # forms the job (torchrun's variables)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    precision = "bf16" if bf16 else None
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext  # noqa: E731
    rank, n = dist.get_rank(), dist.get_world_size()
    chief = rank == 0
    k, per = args.accumulate, args.batch // n
    g = torch.Generator().manual_seed(1)
    # a pool of global micro-batches, taken in the same order by both sides
    pool = [(torch.randint(0, VOCAB, (args.batch, args.seq), generator=g),
             torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)) for _ in range(8 * k)]  # fmt: skip
    mine = slice(rank * per, (rank + 1) * per)

    gpt2 = args.model == "gpt2"

    def batches(start: int, count: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        out = []
        for i in range(start, start + count):
            x, y = pool[i % len(pool)]
            out.append(({"input_ids": x, "labels": y} if gpt2 else {"idx": x, "targets": y}, y))
        return out

    sides: dict[str, tuple[Callable[[int], float], Callable[[], nn.Module]]] = {}

    def fit_side(strategy: sg.Strategy) -> tuple[Callable[[int], float], Callable[[], nn.Module]]:
        with strategy.scope():
            model = make_gpt(args)
            optimizer = optimizer_of(model)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: get_lr(it) / LR)
        taken = [0]
        last = [0.0]

        def run(updates: int) -> float:
            data = batches(taken[0], updates * k)
            taken[0] += updates * k
            history = sg.fit(model, optimizer, None if gpt2 else model_loss, data, epochs=1, strategy=strategy, verbose=0,
                             gradient_accumulation_steps=k, global_clipnorm=1.0, precision=precision,
                             lr_scheduler=schedule, lr_scheduler_interval="step")  # fmt: skip
            last[0] = history.history["loss"][-1]
            return last[0]

        return run, lambda: model

    def hand_side(sharded: bool) -> tuple[Callable[[int], float], Callable[[], nn.Module]]:
        raw = make_gpt(args).to(device)
        if sharded:
            from torch.distributed.fsdp import fully_shard

            for block in blocks_of(raw):
                fully_shard(block)
            fully_shard(raw)
            for m in raw.modules():
                if hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # gloo has no AVG
            model: nn.Module = raw
        else:
            model = nn.parallel.DistributedDataParallel(raw, device_ids=[device.index] if cuda else None)
        optimizer = optimizer_of(raw)
        it = [0]
        taken = [0]

        def run(updates: int) -> float:
            data = batches(taken[0], updates * k)
            taken[0] += updates * k
            loss = torch.zeros(())
            for u in range(updates):  # train.py's loop, as written there
                lr = get_lr(it[0])
                for group in optimizer.param_groups:
                    group["lr"] = lr
                for micro in range(k):
                    last_micro = micro == k - 1
                    if sharded:
                        model.set_requires_gradient_sync(last_micro)  # type: ignore[operator]
                    else:
                        model.require_backward_grad_sync = last_micro  # type: ignore[assignment]
                    inputs, labels = data[u * k + micro]
                    x, y = (inputs["input_ids"] if gpt2 else inputs["idx"])[mine].to(device), labels[mine].to(device)
                    with autocast():
                        loss = forward(model, x, y, gpt2) / k
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                it[0] += 1
            return float(loss.detach()) * k

        return run, lambda: raw

    def pipeline_side() -> tuple[Callable[[int], float], Callable[[], nn.Module]]:
        from real_cases import stages_of, token_mean

        strategy = sg.PipelineStrategy(num_stages=2, num_microbatches=args.microbatches, balance=[4, 4])
        with contextlib.redirect_stdout(io.StringIO()):  # the pipeline's plan
            pipe = strategy.pipeline(stages_of("nanogpt", make_gpt(args)), _token_loss, loss_reduction="mean")
        with strategy.scope():
            optimizer = _decay_groups(pipe.parameters())
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: get_lr(it) / LR)
        taken = [0]

        def run(updates: int) -> float:
            data = [joined(taken[0] + u * k) for u in range(updates)]
            taken[0] += updates * k
            history = sg.fit(pipe, optimizer, token_mean, data, epochs=1, strategy=strategy, verbose=0,
                             global_clipnorm=1.0, lr_scheduler=schedule, lr_scheduler_interval="step")  # fmt: skip
            return float(history.history["loss"][-1])

        return run, lambda: pipe  # type: ignore[return-value]

    def torch_pipeline_side() -> tuple[Callable[[int], float], Callable[[], nn.Module]]:
        from real_cases import sum_tie, torch_gpipe

        part, tied, gpipe = torch_gpipe(make_gpt(args), rank, args.microbatches, _token_loss)
        optimizer = _decay_groups(part.parameters())
        it = [0]
        taken = [0]

        def run(updates: int) -> float:
            for u in range(updates):
                x, y = joined(taken[0] + u * k)
                lr = get_lr(it[0])
                for group in optimizer.param_groups:
                    group["lr"] = lr
                if rank == 0:
                    gpipe.step(x)
                else:
                    gpipe.step(target=y)
                sum_tie(tied)
                # the global norm across both stages, the tie counted once (on stage 0)
                norms = [torch.linalg.vector_norm(p.grad) for p in part.parameters()
                         if p.grad is not None and (rank == 0 or p is not tied)]  # fmt: skip
                squares = torch.stack(norms).square().sum()
                dist.all_reduce(squares)
                coef = float(torch.clamp(1.0 / (squares.sqrt() + 1e-6), max=1.0))
                for p in part.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                it[0] += 1
            taken[0] += updates * k
            return 0.0

        return run, lambda: part

    def joined(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An update's micro-steps as one mini-batch (for the pipelines)."""
        xs, ys = zip(*(pool[(i + j) % len(pool)] for j in range(k)))
        return torch.cat(xs), torch.cat(ys)

    if args.only in (None, "mirrored"):
        sides["fit Mirrored"] = fit_side(sg.MirroredStrategy(devices=args.device))
        sides["train.py DDP"] = hand_side(sharded=False)
    if args.only in (None, "sharded"):
        sides["fit Sharded"] = fit_side(sg.ShardedStrategy(devices=args.device))
        sides["train.py FSDP2"] = hand_side(sharded=True)
    if args.only in (None, "pipeline") and not gpt2 and n == 2 and not cuda:
        sides["fit Pipeline"] = pipeline_side()
        sides["torch pipelining"] = torch_pipeline_side()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def timed(run: Callable[[int], float]) -> float:
        sync()
        start = time.perf_counter()
        run(args.updates)
        sync()
        return args.batch * args.seq * k * args.updates / (time.perf_counter() - start)

    params = sum(p.numel() for p in make_gpt(args).parameters())
    if chief:
        print(f"{'GPT-2 (transformers)' if gpt2 else 'nanoGPT'} {params / 1e6:.1f} M parameters ({args.layers} layers, width {args.width}, seq {args.seq}), "
              f"micro-batch {args.batch} x {args.seq} tokens, {k} micro-steps per update, clip 1.0, per-iteration LR, "
              f"AdamW (configure_optimizers), {n} processes ({'NCCL, ' + torch.cuda.get_device_name(0) if cuda else 'gloo, 1 thread each'}"
              f"{', bf16 autocast' if bf16 else ''}), "
              f"{args.rounds} rounds x {args.updates} updates", flush=True)  # fmt: skip
    for run, _ in sides.values():
        run(1)  # warm-up (one update each)
    runs: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides.items()) if r % 2 == 0 else list(reversed(sides.items()))
        for name, (run, _) in order:
            runs[name].append(timed(run))
    finals = {name: _whole(model()) for name, (_, model) in sides.items()}
    pairs = [(a, b) for a, b in (("fit Mirrored", "train.py DDP"), ("fit Sharded", "train.py FSDP2"),
                                 ("fit Pipeline", "torch pipelining")) if a in runs]  # fmt: skip
    diffs = {}
    for ours, theirs in pairs:  # the largest difference on any process (a pipeline's stages differ)
        d = torch.tensor(max((a - b).abs().max().item() for a, b in zip(finals[ours], finals[theirs])))
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        diffs[ours] = float(d)
    if chief:
        med = {name: statistics.median(v) for name, v in runs.items()}
        mfu = _mfu_per_token(args, gpt2) if cuda else None
        for name, v in runs.items():
            extra = "" if mfu is None else f"  MFU {100 * med[name] * mfu[0] / mfu[1]:5.1f}%"
            print(f"{name:16s} {med[name]:8.0f} tokens/s{extra}  (rounds: {', '.join(f'{x:.0f}' for x in v)})")
        if mfu is not None:
            print(f"MFU: nanoGPT's formula, {mfu[0] / 1e9:.2f} GFLOP per token, against {mfu[2]} "
                  f"({mfu[1] / 1e12:.0f} TFLOPS dense bf16) x {n} GPU{'s' if n > 1 else ''}")  # fmt: skip
        for ours, theirs in pairs:
            paired = statistics.median(a / b for a, b in zip(runs[ours], runs[theirs]))
            diff = diffs[ours]
            print(f"ratio {ours} / {theirs}: {med[ours] / med[theirs]:.3f} of the medians, {paired:.3f} median "
                  f"of the rounds' ratios; parameters after {1 + args.rounds * args.updates} updates differ by "
                  f"at most {diff:.1e}")  # fmt: skip


#: dense bf16 peak FLOPS by GPU name
_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def _mfu_per_token(args: argparse.Namespace, gpt2: bool) -> tuple[float, float, str]:
    """(FLOPs per token by nanoGPT's estimate_mfu formula, the peak FLOPS of all GPUs, what the
    peak is): tokens/s x the first / the second is the MFU."""
    params = sum(p.numel() for p in make_gpt(args).parameters())
    if not gpt2:  # nanoGPT counts without the position embedding (get_num_params)
        params -= args.seq * args.width
    per_token = 6 * params + 12 * args.layers * args.heads * (args.width // args.heads) * args.seq
    name = torch.cuda.get_device_name(0)
    key = next((k for k in _PEAKS if k in name), None)
    peak = _PEAKS[key] if key else _PEAKS["A100"]
    what = name if key else f"{name} (not in the table: A100's peak)"
    return float(per_token), peak * dist.get_world_size(), what


def _token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _decay_groups(params: Any) -> torch.optim.Optimizer:
    """nanoGPT's configure_optimizers groups (decay on matrices only) over ``params``."""
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.99))  # fmt: skip


def _whole(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters as whole tensors (a sharded one gathered), on every rank."""
    out = []
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out.append(t.clone())
    return out


if __name__ == "__main__":
    main()
