"""Run a function (or a script) as N processes of one job, on free ports, with a hard timeout.

Every process gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT as torchrun would set them,
so strategies built inside join the job. Results come back per rank; a process that fails or a
job that outlives ``timeout`` is reported with each rank's exit code and the tail of its output,
and every process is killed: a test never hangs.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratagem.cluster import ClusterSpec, find_free_port
from stratagem.testing.output import stderr_problems
from stratagem.testing.zygote import Zygote


@dataclass
class WorkerResult:
    rank: int
    returncode: int | None
    value: Any
    stdout: str
    stderr: str
    seconds: float


#: the signal on which a test worker prints every thread's Python stack (faulthandler); sent to a
#: worker still running at its timeout, just before it is killed, so a hang names where it was
STACKS_SIGNAL = signal.SIGUSR1

#: the command of a test worker (it registers STACKS_SIGNAL)
_WORKER_CODE = "from stratagem.testing.workers import _main; _main()"


def _tail(text: str, n: int = 30) -> str:
    return "\n".join(text.splitlines()[-n:])


def _report(results: Sequence[WorkerResult], what: str, lines: int = 30) -> str:
    parts = [what]
    for r in results:
        parts.append(f"--- rank {r.rank}: exit {r.returncode} after {r.seconds:.1f}s")
        if r.stderr.strip():
            parts.append(_tail(r.stderr, lines))
        if r.stdout.strip():
            parts.append("[stdout] " + _tail(r.stdout, 10))
    return "\n".join(parts)


#: the zygote of this process's workers (see :mod:`stratagem.testing.zygote`), made on first use
_zygote: Zygote | None = None


def _start(cmd: list[str], env: dict[str, str], out: Any, err: Any, cwd: str | None) -> Any:
    """Start one worker: forked from the zygote when it can be (a ``python -c`` command whose
    environment differs from the zygote's only in late-read variables), else a fresh process."""
    global _zygote
    if cmd[:2] == [sys.executable, "-c"] and len(cmd) == 3 and os.environ.get("STRATAGEM_TEST_ZYGOTE", "1") != "0":
        base = _env(None, {})  # a test may have changed os.environ for good: a zygote to match
        if _zygote is None or _zygote.proc.poll() is not None or not _zygote.accepts(base):
            if _zygote is not None:
                _zygote.close()
            _zygote = Zygote(base)
        if _zygote.accepts(env):
            child = _zygote.start(cmd[2], env, cwd, out, err)
            if child is not None:
                return child
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True, cwd=cwd, start_new_session=True)


def _run(cmds: list[list[str]], envs: list[dict[str, str]], timeout: float, cwd: str | None) -> tuple[list[Any], list[float], bool, list[Any]]:
    files = []
    procs = []
    for cmd, env in zip(cmds, envs):
        out = tempfile.TemporaryFile("w+")
        err = tempfile.TemporaryFile("w+")
        files.append((out, err))
        procs.append(_start(cmd, env, out, err, cwd))
    start = time.monotonic()
    ended = [0.0] * len(procs)
    timed_out = False
    while True:
        for i, p in enumerate(procs):
            if p.poll() is not None and not ended[i]:
                ended[i] = time.monotonic() - start
        if all(p.poll() is not None for p in procs):
            break
        if time.monotonic() - start > timeout:
            timed_out = True
            break
        time.sleep(0.05)
    if timed_out:  # the workers still running print their stacks (others are plain programs)
        stuck = [p for p, cmd in zip(procs, cmds) if p.poll() is None and cmd[-1] == _WORKER_CODE]
        for p in stuck:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, STACKS_SIGNAL)
        if stuck:
            time.sleep(1.0)
    for i, p in enumerate(procs):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            ended[i] = time.monotonic() - start
        else:
            try:  # children the worker itself started
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return procs, ended, timed_out, files


def _env(base: Mapping[str, str] | None, extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "STRATAGEM_LAUNCHER", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(k, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_workers(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    allow_stderr: Sequence[tuple[str, str]] | None = (),
) -> list[WorkerResult]:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes forming one job; its return values by rank.

    ``fn`` must be importable (a module-level function); its return value must be picklable.
    With ``check``, every process must exit 0 and, when they all did, print no traceback, warning
    or error line on stderr but those ``allow_stderr`` explains (``(regex, reason)`` pairs, see
    ``stderr_problems``; None: do not look).
    """
    module = fn.__module__
    qualname = fn.__qualname__
    path = Path(inspect.getfile(fn)).resolve().parent
    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix="stratagem-workers-") as tmp:
        argfile = Path(tmp, "args.pkl")
        argfile.write_bytes(pickle.dumps(tuple(args)))
        cmds, envs = [], []
        for rank in range(nprocs):
            penv = ClusterSpec.local(rank, nprocs, port, source="torchrun")
            extra = {
                **penv.to_environ(),
                "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]),
                "STRATAGEM_TEST_TARGET": f"{module}:{qualname}",
                "STRATAGEM_TEST_ARGS": str(argfile),
                "STRATAGEM_TEST_RESULT": str(Path(tmp, f"result{rank}.pkl")),
            }
            cmds.append([sys.executable, "-c", _WORKER_CODE])
            envs.append(_env(env, extra))
        procs, ended, timed_out, files = _run(cmds, envs, timeout, None)
        results = []
        for rank, (p, secs, (out, err)) in enumerate(zip(procs, ended, files)):
            out.seek(0)
            err.seek(0)
            rfile = Path(tmp, f"result{rank}.pkl")
            value = pickle.loads(rfile.read_bytes()) if rfile.exists() else None
            results.append(WorkerResult(rank, p.returncode, value, out.read(), err.read(), secs))
    if timed_out:
        raise TimeoutError(_report(
            results, f"{qualname} on {nprocs} processes did not finish within {timeout}s "
            "(each one still running printed its threads' stacks, below)", lines=60,
        ))  # fmt: skip
    if check and any(r.returncode != 0 for r in results):
        raise AssertionError(_report(results, f"{qualname} failed on {nprocs} processes"))
    if check and allow_stderr is not None:
        noisy = {r.rank: stderr_problems(r.stderr, allow_stderr) for r in results}
        if any(noisy.values()):
            raise AssertionError(
                _report(results, f"{qualname} on {nprocs} processes succeeded but printed on stderr: "
                        + "; ".join(f"rank {k}: {v[0]}" for k, v in noisy.items() if v))
            )
    return results


def run_script(
    argv: Sequence[str],
    *,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> WorkerResult:
    """Run ``python argv...`` as a user would (no launch variables set), with a hard timeout."""
    procs, ended, timed_out, files = _run([[sys.executable, *argv]], [_env(env, {})], timeout, cwd)
    out, err = files[0]
    out.seek(0)
    err.seek(0)
    result = WorkerResult(0, procs[0].returncode, None, out.read(), err.read(), ended[0])
    if timed_out:
        raise TimeoutError(_report([result], f"{' '.join(argv)} did not finish within {timeout}s"))
    return result


def _main() -> None:
    import faulthandler
    import importlib

    # a worker that dies of a signal (a segfault in torch or a backend) prints every thread's Python
    # stack to its stderr, which the report above shows: the one clue such a death leaves
    faulthandler.enable()
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # the harness's timeout asks for them

    target = os.environ["STRATAGEM_TEST_TARGET"]
    module, qualname = target.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    args = pickle.loads(Path(os.environ["STRATAGEM_TEST_ARGS"]).read_bytes())
    value = obj(*args)
    Path(os.environ["STRATAGEM_TEST_RESULT"]).write_bytes(pickle.dumps(value))
    _end_as_a_program_does()


def _end_as_a_program_does() -> None:
    """End as Python ends a program (threading's exit hooks, then wait for the threads that are
    not daemons, run the exit functions: a strategy's shutdown, logging's), collect what is garbage (a finalizer that
    raises prints here as it would there), and then leave without tearing the interpreter down:
    in a process forked from the zygote, freeing every object copies every page it shares with
    the zygote, 1.1 s of a 1.4 s two-process test on this machine. The documented programs run
    as real processes, their teardown included (tests/test_clean_runs.py)."""
    import atexit
    import gc
    import threading

    # what Py_Finalize does first: threading's exit hooks (they shut down the executors a
    # program keeps, inductor's compile pool say), then wait for the threads that are not daemons.
    # Joining those threads without the hooks hung on a kept executor's workers (CI, a cold
    # inductor cache: tests/test_zygote.py has the case)
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
