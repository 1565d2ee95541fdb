"""Workers for checkpoints under PipelineStrategy (each stage saves and restores its own layers)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from stratagem import Checkpoint, CheckpointManager, PipelineStrategy, RNGState


def pipeline_checkpoint_worker(directory: str, schedule: str = "gpipe") -> dict:
    strategy = PipelineStrategy(2, 2, schedule=schedule, devices="cpu")
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 3))
        pipe = strategy.pipeline(model, nn.CrossEntropyLoss(), verbose=False)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(4)]
    manager = CheckpointManager(Checkpoint(model=model, optimizer=opt, rng=RNGState()), directory, strategy=strategy)
    path, straight, _, resumed = save_and_resume(strategy, pipe, opt, manager, batches)
    return {
        "names": sorted(straight),
        "same": all(torch.equal(straight[k], resumed[k]) for k in straight),
        "latest": manager.latest == path,
    }


def save_and_resume(strategy, pipe, opt, manager, batches, end=None):  # type: ignore[no-untyped-def]
    """Train on the first half, save, train on; wreck the state, restore, train the second half
    again: the checkpoint's path, the state trained straight, the restored ``end`` (a parameter
    name, or None) and the state after the resume."""

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        strategy.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()

    half = len(batches) // 2
    for x, y in batches[:half]:
        step(x, y)
    path = manager.save(half)
    for x, y in batches[half:]:
        step(x, y)
    straight = {k: v.clone() for k, v in pipe.state_dict().items()}
    for p in pipe.parameters():  # wreck the state: restore must bring it back
        p.data.fill_(7.0)
    manager.restore(path)
    restored = pipe.state_dict()[end].clone() if end is not None else None
    for x, y in batches[half:]:
        step(x, y)
    return path, straight, restored, pipe.state_dict()


def pipeline_portable_worker(unsplit_dir: str, out_dir: str, first: int, then: int) -> dict:
    """2 pipeline stages restore the model of a checkpoint written by one process (no strategy),
    train steps ``first..then`` with a fresh Adam (per stage) and save the model."""
    from ckpt_workers import global_batch, portable_model

    strategy = PipelineStrategy(2, 2, devices="cpu")
    with strategy.scope():
        torch.manual_seed(123)  # not the saved values: restore must bring those
        model = portable_model()
        pipe = strategy.pipeline(model, nn.MSELoss(), verbose=False)
    restored = CheckpointManager(Checkpoint(model=model), unsplit_dir, strategy=strategy).restore_or_initialize()
    after_restore = {k: v.clone() for k, v in pipe.state_dict().items()}
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    for s in range(first, then):
        x, y = global_batch(s)
        strategy.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()
    CheckpointManager(Checkpoint(model=model), out_dir, strategy=strategy).save(then)
    return {"restored": restored, "after_restore": after_restore, "params": {k: v.clone() for k, v in pipe.state_dict().items()}}


class _Head(nn.Module):
    """An output head whose weight is the token embedding's (a GPT's tie)."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = emb.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(h).transpose(1, 2)  # [batch, vocab, positions]: for cross_entropy


def tied_model() -> nn.Sequential:
    emb = nn.Embedding(11, 6)
    return nn.Sequential(emb, nn.Linear(6, 6), nn.Tanh(), _Head(emb))


def tied_checkpoint_worker(directory: str) -> dict:
    """2 stages, the embedding (stage 0) tied to the head (stage 1): save, train on, wreck,
    restore, train on again: the same result, the tie holding; then restores of checkpoints
    lacking the tied weight or holding two values for it."""
    from stratagem.train.checkpoint.codec import encode_value
    from stratagem.train.checkpoint.files import (
        _payload,
        read_metadata,
        read_part,
        write_checkpoint,
    )

    strategy = PipelineStrategy(2, 2, balance=[2, 2], devices="cpu")
    torch.manual_seed(0)
    model = tied_model()  # built on the CPU: a tie across stages needs real parameters
    pipe = strategy.pipeline(model, nn.CrossEntropyLoss(), verbose=False)
    with strategy.scope():
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 11, (6, 5), generator=g), torch.randint(0, 11, (6, 5), generator=g)) for _ in range(4)]
    manager = CheckpointManager(Checkpoint(model=model, optimizer=opt), directory, strategy=strategy)
    end = "0.weight" if strategy.extended.stage == 0 else "3.out.weight"
    path, straight, restored_end, resumed = save_and_resume(strategy, pipe, opt, manager, batches, end)
    out = {
        "names": sorted(straight),
        "same": all(torch.equal(straight[k], resumed[k]) for k in straight),
        "restored_end": restored_end,
        "end": resumed[end],
    }
    # checkpoints that are whole files but hold no tied weight, or two different values for it
    meta = read_metadata(Path(path))
    parts = [read_part(Path(path), f"rank-{r}", meta) for r in range(2)]
    for kind in ("missing", "different"):
        altered = [{**p, "model": dict(p["model"])} for p in parts]
        if kind == "missing":
            altered[0]["model"].pop("0.weight")
            altered[0]["model"].pop("3.out.weight")
        else:
            altered[0]["model"]["3.out.weight"] = altered[0]["model"]["0.weight"] + 1
        payloads = []
        for p in altered:
            tensors: dict = {}
            payloads.append(_payload({k: encode_value(v, tensors, k) for k, v in p.items()}, tensors))
        alt_dir = Path(directory) / f"altered-{kind}"
        if strategy.extended.world.rank == 0:
            shared = read_part(Path(path), "shared", meta)
            tensors = {}
            write_checkpoint(alt_dir, 2, _payload({k: encode_value(v, tensors, k) for k, v in shared.items()}, tensors), payloads)
        strategy.extended.world.barrier()
        try:
            CheckpointManager(Checkpoint(model=model, optimizer=opt), alt_dir, strategy=strategy).restore(alt_dir / "ckpt-2")
            out[kind] = "restored"
        except (KeyError, ValueError, RuntimeError) as e:
            out[kind] = f"{type(e).__name__}: {e}"
    return out
