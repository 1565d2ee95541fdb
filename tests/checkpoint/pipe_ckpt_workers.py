"""Workers for checkpoints under PipelineStrategy (each stage saves and restores its own layers)."""

from __future__ import annotations

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

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        strategy.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()

    manager = CheckpointManager(Checkpoint(model=model, optimizer=opt, rng=RNGState()), directory, strategy=strategy)
    for x, y in batches[:2]:
        step(x, y)
    path = manager.save(2)
    for x, y in batches[2:]:
        step(x, y)
    straight = {k: v.clone() for k, v in pipe.state_dict().items()}
    for p in pipe.parameters():  # wreck the state: restore must bring it back
        p.data.fill_(7.0)
    manager.restore(path)
    for x, y in batches[2:]:
        step(x, y)
    resumed = pipe.state_dict()
    return {
        "names": sorted(straight),
        "same": all(torch.equal(straight[k], resumed[k]) for k in straight),
        "latest": manager.latest == path,
    }


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
