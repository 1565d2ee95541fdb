"""Functions the multi-worker tests run as separate processes (module level, importable)."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

from stratagem.cluster.resolvers import TorchrunClusterResolver
from stratagem.comm.failure import FailureOptions
from stratagem.distribute.bootstrap import (
    CommunicationOptions,
    connect_to_cluster,
    initialize_system,
)
from stratagem.distribute.strategies.multi_worker import MultiWorkerMirroredStrategy

FAST = CommunicationOptions(
    timeout_seconds=60, failure=FailureOptions(heartbeat_seconds=0.5, dead_after_seconds=10, grace_seconds=3)
)


def _train_until(strategy, fail_rank: int, how: str, fail_at: int = 3) -> None:
    with strategy.scope():
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = strategy.extended.replica_id
    for step in range(1000):
        if rank == fail_rank and step == fail_at:
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif how == "raise":
                raise ZeroDivisionError("boom on purpose")
            elif how == "hang":
                time.sleep(3600)
            elif how == "return":  # its program ends normally while the others still train
                return
        x = torch.randn(8, 4)

        def step_fn(x):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

        strategy.run(step_fn, args=(x,))
        time.sleep(0.05)


def fail_worker(fail_rank: int, how: str) -> str:
    strategy = MultiWorkerMirroredStrategy(TorchrunClusterResolver(), FAST, devices="cpu")
    _train_until(strategy, fail_rank, how)
    return "unreachable"


def end_early_worker(end_rank: int) -> str:
    strategy = MultiWorkerMirroredStrategy(TorchrunClusterResolver(), FAST, devices="cpu")
    _train_until(strategy, end_rank, "return")
    return "ended"


def uneven_collectives_worker(kind: str) -> str:
    """Replicas that make different collectives (issue 53): ``chief-reduce`` is the tutorial-style
    mistake ``if is_chief: strategy.reduce(...)``; ``extra-all-reduce`` is one more all-reduce on
    rank 1 only (an all-gather, where the others all-reduce the step's gradients)."""
    import stratagem as sg

    strategy = MultiWorkerMirroredStrategy(TorchrunClusterResolver(), FAST, devices="cpu")
    with strategy.scope():
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = strategy.extended.replica_id

    def step_fn(x):
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        opt.step()
        return loss.detach()

    for step in range(1000):
        loss = strategy.run(step_fn, args=(torch.randn(8, 4),))
        if step == 3:
            print(f"MISTAKE {time.time():.3f}", flush=True)
            if kind == "chief-reduce" and sg.is_chief():
                strategy.reduce("SUM", loss, axis=None)
            elif kind == "extra-all-gather" and rank == 1:
                strategy.extended.comm.all_gather_tensor(torch.zeros(3))
        time.sleep(0.02)
    return "unreachable"


def bootstrap_worker(config_rank1: dict, fake_torch_rank1: str | None) -> str:
    resolver = TorchrunClusterResolver()
    connect_to_cluster(resolver, FAST, device="cpu")
    rank = resolver.cluster_spec().rank
    config = {"global_batch": 64}
    if rank == 1:
        config.update(config_rank1)
        if fake_torch_rank1:
            torch.__version__ = fake_torch_rank1  # type: ignore[assignment]
    initialize_system(resolver, FAST, config=config, device="cpu")
    return "initialized"


def exit_worker(how: str) -> str:
    """Exit (normally or by raising) while the failure watcher is inside a store call: the
    store host's server goes away under it at exit; the process must still end cleanly."""
    import datetime

    from stratagem.comm.failure import FailureMonitor

    beat = FailureMonitor._beat

    def slow_beat(self: FailureMonitor) -> None:
        beat(self)
        try:  # park the watcher in the store's C++ client (the GIL released) for a while
            self._store.wait(["stratagem/test/never"], datetime.timedelta(seconds=2))
        except Exception:  # noqa: BLE001
            pass

    FailureMonitor._beat = slow_beat  # type: ignore[method-assign]
    connect_to_cluster(TorchrunClusterResolver(), FAST)
    time.sleep(1.0)  # the watchers are now waiting in the store
    if how == "raise":
        raise ValueError("ended by raising, on purpose")
    return "ok"


def _threads_at_exit() -> None:
    """At the very end of exit (registered first, so it runs last): the threads still running."""
    import sys
    import threading

    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    py = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    sys.stderr.write(f"THREADS-AT-EXIT python={py} native={sorted(names)}\n")
    sys.stderr.flush()


def _tensor_parallel_steps() -> None:
    from stratagem.distribute import DeviceMesh, LayoutMap, ModelParallelStrategy

    mesh = DeviceMesh((2,), ("model",))
    layout = LayoutMap(mesh)
    layout[r"^0\.weight$"] = ("model", None)
    layout[r"^1\.weight$"] = (None, "model")
    strategy = ModelParallelStrategy(mesh, layout, devices="cpu")
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Linear(8, 1, bias=False))
        opt = torch.optim.Adam(model.parameters())

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        opt.step()
        return loss.detach()

    for _ in range(2):
        strategy.run(step, args=(torch.ones(4, 4),))


def leave_worker(how: str) -> str:
    """Join a job, then end (normally, after torch.compile, after tensor-parallel steps, or by
    raising) and report the threads left at exit."""
    import atexit

    atexit.register(_threads_at_exit)
    if how == "tensor_parallel":
        # torch's DeviceMesh holds its process groups, and DTensor's sharding cache holds the mesh
        _tensor_parallel_steps()
        return "ok"
    connect_to_cluster(TorchrunClusterResolver(), FAST)
    if how == "compile":
        # what a program compiling its step does after joining: torch.compile imports torch._dynamo,
        # which imports torch.distributed.nn.functional (its functions' defaults bind group.WORLD)
        torch.compile(nn.Linear(2, 2))
    if how == "raise":
        raise ValueError("ended by raising, on purpose")
    return "ok"


def shapes_worker(bad_step: int) -> str:
    """Global batches alike on every replica except one, at ``bad_step``, on replica 1."""
    strategy = MultiWorkerMirroredStrategy(TorchrunClusterResolver(), FAST, devices="cpu")
    rank = strategy.extended.replica_id
    batches = [torch.ones(4, 3) * s for s in range(5)]
    if rank == 1:
        batches[bad_step] = torch.ones(4, 2)
    it = iter(strategy.experimental_distribute_dataset(batches))
    for _ in range(5):
        next(it)
    return "unreachable"


def first_batch_worker(via: str) -> str:
    """Each replica shuffles the same examples with its own seed (an unseeded shuffle, as each
    process draws it): the first global batches differ. ``via``: "distribute"
    (experimental_distribute_dataset) or "fit" (fit under FailureOptions(on_failure="continue"),
    where every replica reads the whole global batches)."""
    from torch.utils.data import DataLoader, TensorDataset

    import stratagem as sg

    options = CommunicationOptions(timeout_seconds=60, failure=FailureOptions(on_failure="continue"))
    strategy = MultiWorkerMirroredStrategy(TorchrunClusterResolver(), options if via == "fit" else FAST, devices="cpu")
    rank = strategy.extended.replica_id
    data = TensorDataset(torch.arange(32.0).reshape(16, 2), torch.arange(16.0).reshape(16, 1))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(rank))
    if via == "distribute":
        next(iter(strategy.experimental_distribute_dataset(loader)))
    else:
        with strategy.scope():
            model = nn.Linear(2, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sg.fit(model, opt, "mse", loader, epochs=1, verbose=0)
    return "unreachable"
