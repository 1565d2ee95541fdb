"""join: the one way a strategy meets its peers: a ClusterSpec in, the job's Communicator out.

Every strategy constructor (Mirrored, MultiWorkerMirrored, Pipeline) and ``connect_to_cluster``
hand the ClusterSpec they got (from a resolver, a launcher, or the self-launch of
``cluster.launch.ensure_replicas``) to :func:`join`. The process group is formed once per process
and reused by later strategies; a FailureMonitor (heartbeats in the store, a watchdog) explains
failed collectives by rank (``comm.failure.job_probe``).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from stratagem.cluster import ClusterSpec
from stratagem.cluster.launch import children
from stratagem.cluster.stopping import report_stops
from stratagem.comm import (
    Communicator,
    LocalCommunicator,
    ProcessGroupCommunicator,
    init_process_group,
    interfaces,
    release_groups,
)
from stratagem.comm.failure import FailureMonitor, FailureOptions, job_probe
from stratagem.distribute.views import DESCRIBED_BY_EACH, compare_views

_joined: dict[str, Any] = {}


def share_cpu(device: torch.device, local_world_size: int) -> None:
    """CPU replicas on one machine split its cores (unless OMP_NUM_THREADS says otherwise)."""
    if device.type == "cpu" and local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def join(
    spec: ClusterSpec,
    device: torch.device,
    *,
    timeout: float,
    failure: FailureOptions | None = None,
) -> Communicator:
    """The communicator of every process of the job ``spec`` describes (formed on first use)."""
    share_cpu(device, spec.local_world_size)
    if spec.world_size == 1:
        return LocalCommunicator(device)
    existing = _joined.get("comm")
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    if dist.is_initialized():  # a process group the user made: use it as it is
        comm = ProcessGroupCommunicator(dist.group.WORLD, device, probe=job_probe(None))
        _joined["comm"] = comm
        return comm
    # a replica stopped from outside (the launcher, its parent's end) says so in one line, and
    # one that Ctrl-C finds blocked (forming the group with a peer that is gone) still ends
    report_stops(spec.rank, parent_pid=os.getppid() if spec.source == "self" and spec.rank != 0 else None)
    if spec.agent_store:
        _end_with_launcher(spec.rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # across machines, talk on the interface that holds this task's address (gloo would
    # otherwise advertise what the hostname resolves to: loopback on stock Debian/Ubuntu)
    interfaces.pin(_own_host(spec), spec.master_addr, spec.master_port, rank=spec.rank,
                   variables=(interfaces.GLOO, interfaces.NCCL) if device.type == "cuda" else (interfaces.GLOO,))
    options = failure or FailureOptions()
    if options.continues and spec.agent_store:
        raise ValueError(
            "FailureOptions(on_failure='continue') needs the job's store on a replica (MirroredStrategy "
            "starting its replicas itself, or TF_CONFIG's chief): under torchrun or `stratagem run` the "
            "launcher's agent stops every worker when one fails, so nobody would be left to go on"
        )
    monitor = FailureMonitor(
        spec.rank, spec.world_size, spec.master_addr, spec.master_port,
        store_host_rank=None if spec.store_outside else 0,
        prefix=f"stratagem/failure/{spec.restart_count}/",
        options=options,
        shutdown_wait=timeout,
        close_connections=_close_groups,
    )  # fmt: skip
    # (rank 0 too may be one started again, where the store is outside the replicas)
    if options.continues and (spec.rank != 0 or spec.store_outside) and _running_without_me(spec, timeout):
        return _come_back(spec, device, backend, timeout, monitor, options)
    host = spec.rank == 0 and not spec.store_outside
    hosted = None
    if spec.source in DESCRIBED_BY_EACH:  # each process read its own TF_CONFIG: compare them first
        hosted = compare_views(spec, timeout=timeout, attempt=spec.restart_count, host=host)
        _joined["hosted_store"] = hosted  # the store server lives as long as the job's store
    comm, store = init_process_group(
        spec.rank,
        spec.world_size,
        spec.master_addr,
        spec.master_port,
        backend=backend,
        device=device,
        timeout=timeout,
        is_store_server=host and hosted is None,
        probe=job_probe(monitor if options.enabled else None),
        attempt=spec.restart_count,
    )
    _joined["store"] = store
    _remember(comm, spec, backend, timeout, monitor, options)
    if options.enabled:
        kids = children()
        if kids is not None:
            # a replica this process started and that saw a peer fail says so itself, within
            # the monitor's grace: wait that long before stopping it at a crash
            kids.crash_wait = max(kids.crash_wait, options.grace_seconds + 2 * options.heartbeat_seconds + 1.0)
    # registered after the monitor's own exit hook, so it runs first (atexit is LIFO)
    atexit.register(_leave)
    return comm


def _end_with_launcher(rank: int) -> None:
    """A worker torch's agent started (torchrun, ``stratagem run``) ends when the agent does:
    SIGTERM from the kernel at the agent's death (``PR_SET_PDEATHSIG``), which the stop reporter
    turns into one line. Without it a SIGKILLed launcher left its workers running on, holding
    their devices, until their own timeout."""
    from stratagem.cluster.launch import die_with_parent

    die_with_parent()
    if os.getppid() == 1:  # the agent was gone before the request took effect
        sys.stderr.write(f"stratagem: rank {rank}: its launcher (torch's agent) is gone; ending\n")
        sys.stderr.flush()
        os._exit(1)


def _running_without_me(spec: ClusterSpec, timeout: float) -> bool:
    """Whether the job is running on without this rank (it was lost and this process is the
    one started in its place: ``on_failure="continue"``). A process the launcher started as a
    replacement (``STRATAGEM_REPLACEMENT``) waits until the survivors have agreed it was lost."""
    from stratagem.comm.communicator import connect_store
    from stratagem.comm.membership import current

    store = connect_store(spec.master_addr, spec.master_port, spec.world_size, is_master=False,
                          timeout=timeout, rank=spec.rank)  # fmt: skip
    replacement = os.environ.get("STRATAGEM_REPLACEMENT") == "1"
    deadline = time.monotonic() + (timeout if replacement else 0.0)
    while True:
        now = current(store)
        if now is not None and spec.rank not in now[1]:
            _joined["store"] = store
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _come_back(
    spec: ClusterSpec, device: torch.device, backend: str, timeout: float, monitor: FailureMonitor,
    options: FailureOptions,
) -> Communicator:  # fmt: skip
    """Join a running job in the place of lost rank ``spec.rank``: no process group yet (a
    communicator of one, ``ProcessGroupCommunicator.pending``); fit asks to be let in and takes the
    training state from a live peer (``train/failover.py``)."""
    comm = ProcessGroupCommunicator.pending(device, probe=job_probe(monitor if options.enabled else None))
    _joined["coming_back"] = True
    _remember(comm, spec, backend, timeout, monitor, options)
    atexit.register(_leave)
    return comm


def _remember(
    comm: ProcessGroupCommunicator, spec: ClusterSpec, backend: str, timeout: float, monitor: FailureMonitor,
    options: FailureOptions,
) -> None:  # fmt: skip
    """The job this process joined (what ``regroup`` forms again), its monitor started."""
    _joined["comm"] = comm
    _joined["backend"], _joined["timeout"], _joined["rank"], _joined["world"] = backend, timeout, spec.rank, spec.world_size
    if options.enabled:
        if options.continues:  # a wait for a peer known lost gives up
            comm.give_up_when = monitor.lost_peer
        monitor.watch_collectives(comm.log)  # replicas in different collectives are told apart
        _joined["monitor"] = monitor.start()


def coming_back() -> bool:
    """Whether this process came back into a running job and is not let in yet."""
    return bool(_joined.get("coming_back"))


def let_in(members: tuple[int, ...], generation: int) -> Communicator:
    """This process was let in as round ``generation`` decided: the job's process group with it."""
    _joined.pop("coming_back", None)
    return regroup(members, generation)


def _own_host(spec: ClusterSpec) -> str | None:
    """This task's host as the cluster description names it (None where it does not)."""
    return interfaces.host_part(spec.workers[spec.task_index] if spec.workers else "")


def joined_store() -> Any:
    """The rendezvous store of the job this process joined (None before ``join``)."""
    return _joined.get("store")


def failure_monitor() -> FailureMonitor | None:
    """The FailureMonitor of this process (None before ``join`` or when disabled)."""
    return _joined.get("monitor")


def launch_rank() -> int | None:
    """This process's rank as the job started (it keeps it after a regroup; None before join)."""
    return _joined.get("rank")


def launch_world() -> int | None:
    """The number of processes the job started with (None before ``join``)."""
    return _joined.get("world")


def job_timeout() -> float:
    """The job's collective timeout in seconds (120 before ``join``)."""
    return float(_joined.get("timeout", 120.0))


def leave_group() -> None:
    """Destroy this process's process group now (its connections close, so a survivor still
    blocked in a collective with it fails at once): the first step after a lost replica."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group with a failed peer: best effort
            pass
    release_groups()


def regroup(members: tuple[int, ...], generation: int) -> Communicator:
    """Form the job's process group again over ``members`` (ranks as the job started, sorted;
    this process among them) with torch's own ``init_process_group`` under a fresh prefix of the
    job's store, and re-point the job's communicator to it (its holders follow). Returns it."""
    comm = _joined.get("comm")
    store = _joined.get("store")
    me = _joined.get("rank")
    if not isinstance(comm, ProcessGroupCommunicator) or store is None or me is None:
        raise RuntimeError("regroup needs a job formed by stratagem's join (a process group stratagem made)")
    leave_group()
    timeout = float(_joined["timeout"])
    prefixed = dist.PrefixStore(f"stratagem/regroup/{generation}/", store)
    dist.init_process_group(
        _joined["backend"], store=prefixed, rank=members.index(me), world_size=len(members),
        timeout=datetime.timedelta(seconds=timeout),
    )  # fmt: skip
    comm.rejoin(dist.group.WORLD)
    return comm


def _leave() -> None:
    """Leave the job at exit, in the one order that ends cleanly on every rank:

    1. destroy the process group and let every communicator and torch DeviceMesh stratagem made
       drop it, so its C++ object (gloo's threads, its connections) goes while the interpreter is
       whole, bounded in time (a group a user's object still holds, e.g. FSDP's state on a
       sharded model, lives on into finalization);
    2. close the failure monitor: say this rank ended; the store host waits until every peer has
       ended (so the store outlives every peer's teardown); its watcher thread is joined;
    3. drop the store (the store host's server stops) while Python can still run destructors,
       not during interpreter finalization, when a thread woken inside a store call aborts the
       process ("terminate called without an active exception", exit code 134).
    """
    # a collective still in flight (this rank failed in the middle of one) could hold the
    # teardown until the backend's timeout: bounded here, then the process ends at once
    guard = threading.Timer(_LEAVE_LIMIT_S, _leave_stuck)
    guard.daemon = True
    guard.start()
    try:
        _close_groups()
    finally:
        guard.cancel()
        guard.join()  # it ends at once once cancelled: no thread of ours left running at exit
    monitor = _joined.pop("monitor", None)
    if monitor is not None:
        monitor.close()
    store = _joined.pop("store", None)
    hosted = _joined.pop("hosted_store", None)
    if store is not None or hosted is not None:
        del store, hosted
        # a reference to the store in a cycle (a sharded job's torch objects: DTensor's caches,
        # DeviceMesh's groups) would keep its server thread running into finalization until the
        # collector happens to run: collected now, while the interpreter is whole
        gc.collect()


def _close_groups() -> None:
    """Destroy the process groups (their connections close: a peer in a collective with this
    process fails at once) and drop the job's communicator."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    _joined.pop("comm", None)
    # the process groups' C++ objects (gloo threads, the store they hold) go now, not during
    # interpreter finalization: every communicator over them (the world's, a pipeline's
    # sub-groups'; each registered itself, weakly, when made) lets go of its group
    release_groups()


#: how long tearing the process group down at exit may take before the process ends at once
_LEAVE_LIMIT_S = 15.0


def _leave_stuck() -> None:
    sys.stderr.write(
        f"stratagem: tearing the process group down at exit took over {_LEAVE_LIMIT_S:.0f}s (a "
        "collective was still in flight); ending the process\n"
    )
    sys.stderr.flush()
    os._exit(1)
