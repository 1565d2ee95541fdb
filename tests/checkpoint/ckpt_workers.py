"""Functions the checkpoint tests run as separate processes (module level, importable)."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

from stratagem.cluster.resolvers import TorchrunClusterResolver
from stratagem.comm.failure import FailureOptions
from stratagem.data import Dataset
from stratagem.distribute.bootstrap import CommunicationOptions
from stratagem.distribute.strategies.multi_worker import MultiWorkerMirroredStrategy
from stratagem.train.checkpoint import Checkpoint, CheckpointManager, RNGState

FAST = CommunicationOptions(
    timeout_seconds=60, failure=FailureOptions(heartbeat_seconds=0.5, dead_after_seconds=10, grace_seconds=3)
)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 1))


def kill_during_write(directory: str) -> str:
    """Save at step 1; at step 2 die (SIGKILL) after the first file of the checkpoint is written."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = CheckpointManager(Checkpoint(model=model, optimizer=opt), directory, max_to_keep=3)
    manager.save(1)

    def die(name: str) -> None:
        if name == "shared.safetensors":
            os.kill(os.getpid(), signal.SIGKILL)

    manager._on_file_written = die
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    manager.save(2)
    return "unreachable"


def _xy(i):
    g = torch.Generator().manual_seed(int(i))
    x = torch.randn(4, generator=g)
    return x, x.sum(0, keepdim=True).sin()


def resume_worker(directory: str, total: int, stop_after: int | None) -> dict:
    """Train ``total`` steps (2 replicas, shuffled parallel pipeline, dropout, Adam); with
    ``stop_after`` save there and SIGKILL every process. Resumes from ``directory`` if it holds
    a checkpoint."""
    strategy = MultiWorkerMirroredStrategy(TorchrunClusterResolver(), FAST, devices="cpu")
    rank = strategy.extended.replica_id
    torch.manual_seed(0)
    with strategy.scope():
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # replicas' dropout streams differ: RNG state is per rank
    ds = Dataset.range(400).shuffle(64, seed=7).map(_xy, num_parallel_calls=2).batch(8)
    it = iter(strategy.experimental_distribute_dataset(ds))
    step = torch.tensor(0)
    ckpt = Checkpoint(model=model, optimizer=opt, data=it, rng=RNGState(), step=step)
    manager = CheckpointManager(ckpt, directory, max_to_keep=2, strategy=strategy)
    restored = manager.restore_or_initialize()
    seen = []

    def train_step(x, y):
        opt.zero_grad()
        ((model(x) - y) ** 2).sum().div(8).backward()
        opt.step()

    while int(step) < total:
        x, y = next(it)
        seen.append(x.sum().item())
        strategy.run(train_step, args=(x, y))
        step += 1
        if stop_after is not None and int(step) == stop_after:
            manager.save(step)
            os.kill(os.getpid(), signal.SIGKILL)
    return {
        "restored": restored,
        "start": total - len(seen),
        "seen": seen,
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": opt.state_dict(),
    }


# --- portable checkpoints: the same global batches on any number of replicas ----------------------
GLOBAL = 12  # divisible by 1, 2 and 3 replicas


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL, 4, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def portable_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def portable_train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, run=None, rank=0, world=1) -> None:
    """Adam on the mean squared error of each global batch (this replica's share of it)."""
    per = GLOBAL // world
    for s in steps:
        x, y = global_batch(s)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]

        def step(x, y):
            opt.zero_grad()
            ((model(x) - y) ** 2).sum().div(GLOBAL).backward()
            opt.step()

        (run or (lambda f, args: f(*args)))(step, (x, y))


def portable_worker(directory: str, first: int, then: int, restore: bool) -> dict:
    """On N replicas: restore the newest checkpoint of ``directory`` (``restore``) or start
    fresh, train steps ``first..then`` and save at ``then``."""
    strategy = MultiWorkerMirroredStrategy(TorchrunClusterResolver(), FAST, devices="cpu")
    rank, world = strategy.extended.replica_id, strategy.num_replicas_in_sync
    with strategy.scope():
        model = portable_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = CheckpointManager(Checkpoint(model=model, optimizer=opt, rng=RNGState()), directory, strategy=strategy)
    restored = manager.restore_or_initialize() if restore else None
    portable_train(model, opt, range(first, then), lambda f, args: strategy.run(f, args=args), rank, world)
    manager.save(then)
    return {"restored": restored, "params": {k: v.clone() for k, v in model.state_dict().items()}}


def _own_filesystem_at(path: str) -> None:
    """This process sees a fresh, private filesystem at ``path`` (a tmpfs in a mount namespace of
    its own, as another host without shared storage would): what it writes there no other sees."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ms_rec, ms_private, clone_newns = 16384, 1 << 18, 0x00020000
    if libc.unshare(clone_newns) != 0 or libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0:
        raise OSError(ctypes.get_errno(), "unshare/mount --make-rprivate")
    os.makedirs(path, exist_ok=True)
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount tmpfs on {path}")


def sharded_save_worker(tmp: str, how: str) -> dict:
    """A ShardedStrategy checkpoint saved by 2 processes that do not write one directory:
    ``how`` = "tf_idiom" (TensorFlow's write_filepath: the other worker names its own temporary
    directory) or "unshared" (one path, but replica 1 sees a filesystem of its own there)."""
    from stratagem.distribute.strategies.sharded import ShardedStrategy

    strategy = ShardedStrategy()
    rank = strategy.extended.replica_id
    with strategy.scope():
        model = make_model()
        opt = torch.optim.Adam(model.parameters())
    directory = os.path.join(tmp, "ckpt")
    if how == "tf_idiom" and rank != 0:
        directory = os.path.join(tmp, f"workertemp_{rank}", "ckpt")
    if how == "unshared" and rank == 1:
        _own_filesystem_at(directory)
    manager = CheckpointManager(Checkpoint(model=model, optimizer=opt), directory, max_to_keep=1)
    try:
        manager.save()
        error = ""
    except Exception as e:  # noqa: BLE001 - what each replica met is the result
        error = f"{type(e).__name__}: {e}"
    def listing(d: str) -> list[str] | None:  # but the lock the manager holds on its directory
        return sorted(n for n in os.listdir(d) if n != ".stratagem-writer.lock") if os.path.isdir(d) else None

    left = listing(directory)
    strategy.extended.world.barrier()
    return {"error": error, "left": left, "chief_sees": listing(os.path.join(tmp, "ckpt"))}
