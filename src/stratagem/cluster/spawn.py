"""launch(fn, num_replicas=N): run a function as N fresh replica processes from anywhere, never hang.

``torch.multiprocessing.spawn`` and Accelerate's ``notebook_launcher`` play this role elsewhere.
Unlike ``cluster.launch.ensure_replicas`` (which re-runs the script), nothing is re-run: each of
the N children is a fresh interpreter that receives ``fn`` and its arguments, sets the launch
environment of its rank (``ClusterSpec.local(...).to_environ()``, as torchrun would), runs
``fn(*args, **kwargs)`` and sends back its result or its traceback. So a strategy built inside
``fn`` joins the job, from a notebook, a REPL, ``python -c`` or a script.

Why fresh interpreters and not ``fork``: the caller may already hold torch's intra-op thread
pool, a process group, dynamo's compile workers or a notebook kernel's ZMQ threads, and a forked
child of a threaded process can deadlock on a lock held by a thread that did not come along.
Why cloudpickle: a function defined in a notebook cell or in ``python -c`` lives in ``__main__``,
which a fresh interpreter cannot import; cloudpickle ships such functions by value (and
importable ones by reference). Without it, only importable functions can be launched.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from stratagem.cluster.launch import die_with_parent, find_free_port
from stratagem.cluster.spec import ClusterSpec

#: the child's entry point; its environment names the payload and the result files.
_BOOTSTRAP = "from stratagem.cluster.spawn import _child_main; _child_main()"
_PAYLOAD_VAR = "STRATAGEM_LAUNCH_PAYLOAD"
_RESULT_VAR = "STRATAGEM_LAUNCH_RESULT"
_PARENT_VAR = "STRATAGEM_LAUNCH_PARENT"


class LaunchError(RuntimeError):
    """A replica started by :func:`launch` failed; ``rank`` and its ``traceback`` say how."""

    def __init__(self, message: str, rank: int | None = None, traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The replicas started by :func:`launch` did not finish within its ``timeout``."""


@dataclass(frozen=True)
class _Outcome:
    ok: bool
    value: Any = None
    error: str = ""  # "ValueError: boom"
    traceback: str = ""


def _pickler() -> Any:
    try:
        import cloudpickle

        return cloudpickle
    except ImportError:  # pragma: no cover - cloudpickle is in the dev extra
        return pickle


def _dumps(obj: Any, what: str) -> bytes:
    module = _pickler()
    try:
        return bytes(module.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as e:
        hint = (
            "" if module is not pickle else
            "; functions defined in a notebook, a REPL or `python -c` need cloudpickle: "
            "pip install cloudpickle"
        )  # fmt: skip
        raise TypeError(f"cannot send {what} to the replicas: {type(e).__name__}: {e}{hint}") from e


def _child_main() -> None:  # runs in each replica: load the payload, run fn, report
    import traceback

    die_with_parent()  # here, not in preexec_fn: that is unsafe when the caller has threads
    if os.getppid() != int(os.environ.pop(_PARENT_VAR, os.getppid())):
        os._exit(1)  # the caller died before the line above took effect
    result_path = os.environ.pop(_RESULT_VAR)
    rank = int(os.environ["RANK"])
    try:
        with open(os.environ.pop(_PAYLOAD_VAR), "rb") as f:
            path = pickle.load(f)  # the caller's sys.path first: fn may live in its modules
            sys.path[:0] = [p for p in path if p not in sys.path]
            fn, args, kwargs = pickle.load(f)
        value = fn(*args, **kwargs)
        outcome = _Outcome(True, value if rank == 0 else None)
        data = _dumps(outcome, "the result of rank 0")
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        outcome = _Outcome(False, None, f"{type(e).__name__}: {e}", traceback.format_exc())
        data = pickle.dumps(outcome)
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, result_path)
    if outcome.ok:
        _leave_together()
    sys.stdout.flush()
    sys.stderr.flush()
    # a process group or worker threads may still be up: leave without waiting on them
    os._exit(0 if outcome.ok else 1)


def _leave_together() -> None:
    """Wait for the peers before leaving: rank 0 hosts the job's store, and a peer still joining
    or finishing a collective would fail if it vanished. (A failed peer ends this wait with an
    error, or the caller stops this process after ``grace``.)"""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    except Exception:  # noqa: BLE001 - leaving anyway; the result is already written
        pass


class _Relay(threading.Thread):
    """Copies one child's output to the caller's stream (a notebook cell's, say), keeps a tail."""

    def __init__(self, pipe: IO[bytes], stream: Any) -> None:
        super().__init__(daemon=True, name="stratagem-launch-relay")
        self.pipe = pipe
        self.stream = stream
        self.lines: list[str] = []

    def run(self) -> None:
        for raw in iter(self.pipe.readline, b""):
            line = raw.decode(errors="replace")
            self.lines = [*self.lines[-29:], line]
            try:
                self.stream.write(line)
                self.stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not kill the relay
                pass

    def tail(self) -> str:
        return "".join(self.lines)


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the replica and anything it started
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        p.wait()


def launch(
    fn: Callable[..., Any],
    *args: Any,
    num_replicas: int = 2,
    timeout: float | None = None,
    grace: float = 10.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` as each of ``num_replicas`` new processes; return rank 0's result.

    Each process sees the launch environment of its rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*),
    so ``MirroredStrategy("cpu", num_replicas=N)`` inside ``fn`` joins the job. ``fn`` may be
    defined anywhere (a notebook cell, ``python -c``, a script, a module); its arguments and rank
    0's result travel by (cloud)pickle. If a replica fails, the others get ``grace`` seconds to
    stop by themselves (they usually fail in their next collective), then all are killed and a
    :class:`LaunchError` carries the failing rank's traceback. ``timeout`` (seconds) bounds the
    whole run: past it every replica is killed and :class:`LaunchTimeoutError` is raised. The
    replicas also die if this process dies. ``env`` adds environment variables for the replicas;
    OMP_NUM_THREADS defaults to the CPU count divided by ``num_replicas``.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if _pickler() is pickle and getattr(fn, "__module__", None) == "__main__":
        raise TypeError(
            f"{getattr(fn, '__qualname__', fn)!r} is defined in __main__ (a notebook, a REPL, "
            "`python -c` or the script itself), which the replicas cannot import; "
            "pip install cloudpickle (it ships such functions by value), or move it to a module"
        )
    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix="stratagem-launch-") as tmp:
        payload = os.path.join(tmp, "payload.pkl")
        with open(payload, "wb") as f:
            pickle.dump(list(sys.path), f)
            f.write(_dumps((fn, args, kwargs), f"{getattr(fn, '__qualname__', fn)!r} and its arguments"))
        base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_replicas)))
        base.update(env or {})
        procs: list[subprocess.Popen[bytes]] = []
        relays: list[tuple[_Relay, _Relay]] = []
        results = [os.path.join(tmp, f"rank{r}.pkl") for r in range(num_replicas)]
        try:
            for rank in range(num_replicas):
                spec = ClusterSpec.local(rank, num_replicas, port, source="launch")
                child_env = {**base, **spec.to_environ(), _PAYLOAD_VAR: payload, _RESULT_VAR: results[rank],
                             _PARENT_VAR: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
                p = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP], env=child_env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                )  # fmt: skip
                procs.append(p)
                assert p.stdout is not None and p.stderr is not None
                pair = (_Relay(p.stdout, sys.stdout), _Relay(p.stderr, sys.stderr))
                for r in pair:
                    r.start()
                relays.append(pair)
            _wait(procs, timeout, grace, relays)
        finally:
            _kill(procs)
            for pair in relays:
                for r in pair:
                    r.join(timeout=5)
        return _collect(procs, results, relays, num_replicas)


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float | None, grace: float, relays: Any) -> None:
    start = time.monotonic()
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > grace:
            return  # the survivors are stuck waiting for the failed one: _kill stops them
        if timeout is not None and now - start > timeout:
            running = [r for r, c in enumerate(codes) if c is None]
            tails = "\n".join(
                f"--- rank {r} (still running) stderr:\n{relays[r][1].tail()}" for r in running
            )
            _kill(procs)
            raise LaunchTimeoutError(
                f"the {len(procs)} replicas did not finish within timeout={timeout:g}s; ranks "
                f"{running} were still running and were killed. Raise `timeout`, or look for a "
                f"replica stuck in a collective its peers never reached.\n{tails}"
            )
        time.sleep(0.02)


def _read(path: str) -> _Outcome | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        outcome = pickle.load(f)
    assert isinstance(outcome, _Outcome)
    return outcome


def _collect(procs: list[subprocess.Popen[bytes]], results: list[str], relays: Any, n: int) -> Any:
    outcomes = [_read(path) for path in results]
    failures = [r for r in range(n) if outcomes[r] is None or not outcomes[r].ok]  # type: ignore[union-attr]
    if not failures:
        outcome = outcomes[0]
        assert outcome is not None
        return outcome.value
    # the cause is a rank that raised by itself; a peer that then failed in a collective (or was
    # killed while waiting) is a consequence. Prefer a rank whose error is not a collective's.
    def is_consequence(r: int) -> bool:
        o = outcomes[r]
        return o is None or any(k in o.error for k in ("WorkerFailedError", "CollectiveTimeoutError", "CollectiveError", "DistBackendError"))

    rank = next((r for r in failures if not is_consequence(r)), None)
    if rank is None:
        rank = next((r for r in failures if outcomes[r] is not None), failures[0])
    o = outcomes[rank]
    others = [r for r in failures if r != rank]
    also = f" (ranks {others} failed or were stopped too)" if others else ""
    if o is None:
        code = procs[rank].returncode
        tail = relays[rank][1].tail()
        raise LaunchError(
            f"replica {rank} of {n} died with exit code {code} before reporting{also}; "
            f"its last output:\n{tail}",
            rank, tail,
        )  # fmt: skip
    raise LaunchError(
        f"replica {rank} of {n} failed with {o.error}{also}\n\n"
        f"Traceback on rank {rank}:\n{o.traceback}",
        rank, o.traceback,
    )  # fmt: skip


__all__ = ["LaunchError", "LaunchTimeoutError", "launch"]
