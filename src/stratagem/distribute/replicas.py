"""join_group: turn a ProcessEnv into the Communicator of every replica of the job (once per process)."""

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from stratagem.cluster import ProcessEnv
from stratagem.cluster.launch import children
from stratagem.comm import (
    Communicator,
    LocalCommunicator,
    ProcessGroupCommunicator,
    init_process_group,
)
from stratagem.comm.failure import FailureMonitor, FailureOptions

_joined: dict[str, Any] = {}


def _probe(exc: BaseException) -> tuple[int | None, str]:
    """Which replica failed, as far as the launcher of this process knows."""
    kids = children()
    if kids is not None:
        import time

        deadline = time.monotonic() + 2.0
        while kids.failed is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if kids.failed is not None:
            rank, code = kids.failed
            return rank, f"it exited with code {code}"
    return None, ""


def local_device(local_rank: int, devices: Sequence[torch.device] | None = None) -> torch.device:
    """This process's device: ``devices[local_rank]``, else GPU ``local_rank`` (mod the count)
    when there are GPUs, else the CPU."""
    if devices:
        return devices[local_rank % len(devices)]
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def share_cpu(device: torch.device, local_world_size: int) -> None:
    """CPU replicas on one machine split its cores (unless OMP_NUM_THREADS says otherwise)."""
    if device.type == "cpu" and local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def join_group(
    env: ProcessEnv,
    device: torch.device,
    *,
    timeout: float,
    failure: FailureOptions | None = None,
) -> Communicator:
    """The communicator of this job; the process group is formed on first use and reused.

    A FailureMonitor (heartbeats in the store, a watchdog) explains failed collectives by rank.
    """
    if env.world_size == 1:
        return LocalCommunicator(device)
    if dist.is_initialized():
        existing = _joined.get("comm")
        if existing is not None:
            return existing  # type: ignore[no-any-return]
        return ProcessGroupCommunicator(dist.group.WORLD, device, probe=_probe)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    options = failure or FailureOptions()
    monitor = FailureMonitor(
        env.rank, env.world_size, env.master_addr, env.master_port,
        store_host_rank=None if agent_store else 0,
        prefix=f"stratagem/failure/{env.restart_count}/",
        options=options,
        shutdown_wait=timeout,
    )

    def probe(exc: BaseException) -> tuple[int | None, str]:
        rank, why = monitor.probe(exc) if options.enabled else (None, "")
        return (rank, why) if rank is not None else _probe(exc)

    comm, store = init_process_group(
        env.rank,
        env.world_size,
        env.master_addr,
        env.master_port,
        backend=backend,
        device=device,
        timeout=timeout,
        is_store_server=env.rank == 0 and not agent_store,
        probe=probe,
    )
    _joined["comm"] = comm
    _joined["store"] = store
    if options.enabled:
        _joined["monitor"] = monitor.start()
    # registered after the monitor's own exit hook, so it runs first (atexit is LIFO): the
    # process group is torn down before this rank tells the store host it has ended, and the
    # store host outlives every peer's teardown
    atexit.register(_leave)
    return comm


def joined_store() -> Any:
    """The rendezvous store of the job this process joined (None before ``join_group``)."""
    return _joined.get("store")


def failure_monitor() -> FailureMonitor | None:
    """The FailureMonitor of this process (None before ``join_group`` or when disabled)."""
    return _joined.get("monitor")


def _leave() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
