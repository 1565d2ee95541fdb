"""Compare each process's view of the cluster at the rendezvous: clusters that disagree end at once.

Each process of a job described process by process (TF_CONFIG, a Slurm step, a resolver given by
hand) read its own description. Two workers both given index 0, a worker whose TF_CONFIG lists
3 workers where the chief's lists 2, an address typed differently: each process would wait at
the rendezvous for peers that never come, until the timeout. So, before the process group is
formed, every process meets in the rendezvous store and compares, at a cost per rank that does
not grow with the job:

- the chief (rank 0) hosts the store and publishes its view's digest and a one-line summary
  (and the full view, read only by a process whose digest differs, to say what differs);
- every other rank claims its rank (``add``: a second claimer is a duplicate task), reads the
  chief's digest and compares it with its own; a difference is published as the job's verdict;
- a process that cannot host the store because another chief already does is a duplicate chief
  (two tasks with index 0): it publishes that verdict through the other's store;
- the last rank to arrive publishes "ok"; every rank waits for the verdict (one blocking
  ``wait``, no polling) and raises ``ClusterConfigurationError`` naming both views if it is not.

A task whose address points at no listening chief is not found here (the processes never meet);
the store connection's own error names the address.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import time
from typing import Any

from stratagem.cluster import ClusterSpec
from stratagem.comm.errors import CollectiveError

#: the launchers whose processes each read their own description of the job (torchrun's and
#: stratagem's own launches are described once, by the launcher, to every process)
DESCRIBED_BY_EACH = ("tf_config", "slurm", "simple")

#: how long a duplicate chief looks for the other chief's view in the store it found
_DUPLICATE_LOOK_S = 5.0

#: how long, at most, the chief keeps the store up for the others to read a verdict of disagreement
_LINGER_S = 10.0


class ClusterConfigurationError(RuntimeError):
    """Workers of one job disagree (versions, world size, configuration, their cluster); raised on
    every worker."""


def digest(spec: ClusterSpec) -> str:
    """A short digest of ``spec.view()`` (what every process must be told alike)."""
    text = json.dumps(spec.view(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _entry(spec: ClusterSpec) -> dict[str, Any]:
    """What a process publishes about itself: O(1) in the size of the job."""
    return {
        "digest": digest(spec),
        "summary": spec.summary(),
        "task": spec.task_name,
        "rank": spec.rank,
        "where": f"pid {os.getpid()} on {socket.gethostname()}",
    }


def _who(entry: dict[str, Any]) -> str:
    return f"task {entry['task']} (rank {entry['rank']}, {entry['where']})"


def differences(mine: dict[str, Any], theirs: dict[str, Any], limit: int = 4) -> list[str]:
    """What differs between two views, in words ("worker: 3 tasks here, 2 at the chief")."""
    out: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if key not in a or key not in b:
                    side = "the chief's" if key not in a else "this one's"
                    out.append(f"{path}{key} is only in {side}")
                else:
                    walk(a[key], b[key], f"{path}{key} ")
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                out.append(f"{path}has {len(a)} entries {_short(a)} here but {len(b)} {_short(b)} at the chief")
            else:
                for i, (x, y) in enumerate(zip(a, b)):
                    if x != y:
                        out.append(f"{path}{i} is {x!r} here but {y!r} at the chief")
        elif a != b:
            out.append(f"{path}is {a!r} here but {b!r} at the chief")

    walk(mine, theirs, "")
    return out[:limit] + ([f"and {len(out) - limit} more"] if len(out) > limit else [])


def _short(items: list[Any], n: int = 4) -> str:
    shown = ", ".join(map(str, items[:n]))
    return f"[{shown}{', ...' if len(items) > n else ''}]"


def _advice(spec: ClusterSpec) -> str:
    if spec.source == "tf_config":
        return (
            "start every worker with the same TF_CONFIG cluster (the same tasks, in the same order, "
            "with the same addresses), each with its own task index"
        )
    return "start every process with the same description of the job, each with its own rank"


def compare_views(spec: ClusterSpec, *, timeout: float, attempt: int = 0, host: bool) -> Any:
    """Meet the job's other processes in the rendezvous store and compare views (see the module
    docstring). ``host``: this process hosts the store (the chief); the store it hosts is
    returned, to be kept alive while the job runs (else None). Raises
    ``ClusterConfigurationError`` when the views disagree, on every process that meets."""
    from stratagem.comm.communicator import connect_store

    deadline = time.monotonic() + timeout
    prefix = f"stratagem/views/{attempt}/"
    me = _entry(spec)
    if host:
        try:
            store = connect_store(spec.master_addr, spec.master_port, spec.world_size, is_master=True,
                                  timeout=timeout, rank=spec.rank)  # fmt: skip
        except CollectiveError as e:
            _duplicate_chief(spec, me, prefix)
            raise e
        store.set(prefix + "full", json.dumps(spec.view()))
        store.set(prefix + "0", json.dumps(me))
    else:
        store = connect_store(spec.master_addr, spec.master_port, spec.world_size, is_master=False,
                              timeout=timeout, rank=spec.rank)  # fmt: skip
        claim = prefix + f"claim/{spec.rank}"
        if store.add(claim, 1) > 1:
            other = _read(store, prefix + f"who/{spec.rank}", _DUPLICATE_LOOK_S)
            holder = _who(other) if other is not None else "another process"
            _verdict(store, prefix, ClusterConfigurationError(
                f"two processes were given rank {spec.rank} (task {spec.task_name}): {holder} and "
                f"{_who(me)}; {_advice(spec)} (or, if this process was started again while the job "
                "runs, restart the whole job)"
            ))  # fmt: skip
        store.set(prefix + f"who/{spec.rank}", json.dumps(me))
        chief = _read(store, prefix + "0", max(deadline - time.monotonic(), 0.0))
        if chief is None:
            raise CollectiveError(
                f"rank {spec.rank} reached the rendezvous store at {spec.master} but the chief never "
                f"said it was there within {timeout:g}s"
            )
        if chief["digest"] != me["digest"]:
            full = _read(store, prefix + "full", _DUPLICATE_LOOK_S)
            what = differences(spec.view(), full) if isinstance(full, dict) else []
            _verdict(store, prefix, ClusterConfigurationError(
                f"the processes of this job were told different clusters: {_who(me)} was given "
                f"{me['summary']}, but the chief, {_who(chief)}, was given {chief['summary']}"
                f"{' (' + '; '.join(what) + ')' if what else ''}; {_advice(spec)}"
            ))  # fmt: skip
    if store.add(prefix + "count", 1) == spec.world_size:
        store.compare_set(prefix + "done", "", "ok")
    verdict = _get(store, prefix + "done", max(deadline - time.monotonic(), 0.0))
    if verdict is None:
        raise CollectiveError(
            f"rank {spec.rank} of {spec.world_size}: {_absent(store, prefix, spec)} never joined the job "
            f"at {spec.master} within {timeout:g}s (not started, or started with another cluster: "
            "check that every worker was started with the same TF_CONFIG / --nnodes and "
            "--rdzv-endpoint, and that its host can reach this address)"
        )
    if verdict != "ok":
        if host:  # the store ends with this process: first let the others read the verdict
            _linger(store, prefix, spec.world_size, min(timeout, _LINGER_S))
        else:
            store.add(prefix + "read", 1)
        raise ClusterConfigurationError(verdict.removeprefix("error: "))
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store if host else None


def _absent(store: Any, prefix: str, spec: ClusterSpec) -> str:
    """Who never came, in words: on the chief, the ranks (it alone looks at every rank's key,
    once, after the timeout); elsewhere how many came (one read)."""
    try:
        if spec.rank == 0:
            missing = [r for r in range(1, spec.world_size) if not store.check([prefix + f"claim/{r}"])]
            names = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            return f"rank{'s' if len(missing) != 1 else ''} {names or '?'}"
        came = int(store.add(prefix + "count", 0))
        return f"{spec.world_size - came} of the {spec.world_size} processes"
    except (RuntimeError, OSError):  # the store is gone with its host
        return "some of the processes"


def _duplicate_chief(spec: ClusterSpec, me: dict[str, Any], prefix: str) -> None:
    """This process was told it is the chief but could not host the store: if another chief of
    this job already hosts it there (two tasks given index 0), say so to both; else return (the
    caller raises its own error)."""
    from stratagem.comm.communicator import connect_store

    try:
        store = connect_store(spec.master_addr, spec.master_port, spec.world_size, is_master=False,
                              timeout=_DUPLICATE_LOOK_S, rank=spec.rank)  # fmt: skip
        other = _read(store, prefix + "0", _DUPLICATE_LOOK_S)
    except (CollectiveError, RuntimeError):
        return
    if other is None:
        return
    _verdict(store, prefix, ClusterConfigurationError(
        f"two processes were given rank 0 (task {spec.task_name}, the chief, whose address "
        f"{spec.master} is the rendezvous): {_who(other)} hosts the rendezvous, and {_who(me)} "
        f"could not host it there too; {_advice(spec)} (or an earlier job still holds "
        f"{spec.master}: stop it)"
    ))  # fmt: skip


def _linger(store: Any, prefix: str, world_size: int, seconds: float) -> None:
    """On the chief, after a verdict that the views disagree: keep the store up until the
    job's other ranks have read it (each adds one to ``read``), at most ``seconds``; a rank that
    reaches the store later finds nobody there, and its own timeout names the address."""
    end = time.monotonic() + seconds
    pause = 0.01
    while time.monotonic() < end:
        try:
            if int(store.add(prefix + "read", 0)) >= world_size - 1:
                return
        except (RuntimeError, OSError):
            return
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def _verdict(store: Any, prefix: str, error: ClusterConfigurationError) -> None:
    """Publish ``error`` as the job's verdict (unless one was given already) and raise it here."""
    try:
        store.compare_set(prefix + "done", "", f"error: {error}")
        store.add(prefix + "read", 1)
    except (RuntimeError, OSError):  # the store went away: this process still says it
        pass
    raise error from None


def _get(store: Any, key: str, seconds: float) -> str | None:
    """The value of ``key`` once it is set, within ``seconds`` (None if it never is): one
    blocking ``get``, which hands the value over as it is set (a ``wait`` then a ``get`` could
    find the store gone in between: a chief that raised the verdict ends at once)."""
    try:
        store.set_timeout(datetime.timedelta(seconds=max(seconds, 0.01)))
        return bytes(store.get(key)).decode()
    except (RuntimeError, OSError):  # torch's DistStoreError is a RuntimeError: a timeout
        return None


def _read(store: Any, key: str, seconds: float) -> Any:
    """The JSON value of ``key`` once it is set, within ``seconds`` (None if it never is)."""
    value = _get(store, key, seconds)
    return None if value is None else json.loads(value)
