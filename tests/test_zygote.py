"""The harness's zygote: a worker forked from it behaves as `python -c CODE` started afresh with
the request's environment would (exit codes, output, environment, session, interpreter exit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from stratagem.testing.workers import _env
from stratagem.testing.zygote import Zygote

CODE = textwrap.dedent("""
    import atexit, os, sys
    atexit.register(lambda: print("atexit ran", flush=True))
    print("argv", sys.argv, "rank", os.environ["RANK"], "cwd", os.getcwd(), flush=True)
    print("sid", os.getsid(0) == os.getpid(), "torch" in sys.modules, file=sys.stderr, flush=True)
    what = os.environ["WHAT"]
    if what == "raise":
        raise ValueError("boom")
    if what == "exit":
        sys.exit(3)
    if what == "kill":
        os.kill(os.getpid(), 9)
""")


def _run(start, what: str, tmp: str) -> tuple[int, str, str]:
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    env = _env(None, {"RANK": "1", "WHAT": what})
    proc = start(env, out, err)
    code = proc.wait(60)
    out.seek(0)
    err.seek(0)
    return code, out.read(), err.read()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(_env(None, {}))
    yield z
    z.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what,code", [("ok", 0), ("raise", 1), ("exit", 3), ("kill", -9)])
@pytest.mark.slow
def test_a_forked_worker_is_what_a_fresh_process_would_be(zygote, tmp_path, what, code):
    def forked(env, out, err):
        child = zygote.start(CODE, env, str(tmp_path), out, err)
        assert child is not None
        return child

    def fresh(env, out, err):
        return subprocess.Popen([sys.executable, "-c", CODE], env=env, stdout=out, stderr=err,
                                cwd=str(tmp_path), start_new_session=True, text=True)

    a = _run(forked, what, str(tmp_path))
    b = _run(fresh, what, str(tmp_path))
    assert a[0] == b[0] == code, (a, b)
    assert a[1] == b[1], (a[1], b[1])  # argv ['-c'], the request's environment and cwd, atexit
    assert f"cwd {tmp_path}" in a[1] and "rank 1" in a[1]
    # its own session; torch already imported (the point), where a fresh one has not
    assert a[2].splitlines()[0] == "sid True True" and b[2].splitlines()[0] == "sid True False"
    if what == "raise":
        assert a[2].splitlines()[-1] == b[2].splitlines()[-1] == "ValueError: boom"


def test_an_environment_that_differs_at_import_is_not_forked(zygote):
    assert zygote.accepts(_env(None, {"RANK": "3", "MASTER_PORT": "1234"}))
    assert not zygote.accepts(_env(None, {"OMP_NUM_THREADS": "7"}))
    assert not zygote.accepts(_env(None, {"TORCH_LOGS": "+dynamo"}))


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_killed_worker_s_group_goes_and_the_zygote_serves_on(zygote, tmp_path):
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    child = zygote.start("import time; time.sleep(60)", _env(None, {}), str(tmp_path), out, err)
    assert child is not None and child.poll() is None
    os.killpg(child.pid, signal.SIGKILL)  # as the harness does at its timeout
    assert child.wait(30) == -9
    again = zygote.start("pass", _env(None, {}), str(tmp_path), out, err)
    assert again is not None and again.wait(30) == 0


def parent_pid() -> int:
    return os.getppid()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attempt", [1, 2])  # a later test too (pytest changes the environment per test)
def test_run_workers_forks_its_workers_from_the_zygote(attempt):
    from stratagem.testing import workers

    results = workers.run_workers(parent_pid, 2, timeout=60)
    assert workers._zygote is not None
    assert [r.value for r in results] == [workers._zygote.proc.pid] * 2


def stuck_worker() -> None:
    import threading
    import time

    threading.Thread(target=time.sleep, args=(60,), name="a-helper-thread", daemon=True).start()
    time.sleep(60)  # the line a timeout's report must point at


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_worker_still_running_at_the_timeout_prints_where_it_is():
    """A hang in CI is one chance to learn where it was: a worker that outlives run_workers'
    timeout prints every thread's Python stack before it is killed, and the error shows it."""
    from stratagem.testing.workers import run_workers

    with pytest.raises(TimeoutError) as e:
        run_workers(stuck_worker, 2, timeout=5)
    report = str(e.value)
    assert "stuck_worker on 2 processes did not finish within 5s" in report
    for rank in (0, 1):
        start = report.index(f"--- rank {rank}: exit -9")
        mine = report[start : report.find("--- rank", start + 1) if rank == 0 else len(report)]
        assert 'in stuck_worker' in mine and "test_zygote.py" in mine, report
        assert mine.count("hread 0x") >= 2, report  # "Current thread 0x..." and the helper's "Thread 0x..."


_POOLS: list = []


def executor_worker() -> str:
    from concurrent.futures import ThreadPoolExecutor

    # kept and never shut down, as inductor keeps its compile pool: Python's exit shuts it down
    # (threading's exit hooks) before it waits for the threads that are not daemons
    _POOLS.append(ThreadPoolExecutor(2))
    return _POOLS[0].submit(lambda: "done").result()


@pytest.mark.timeout(60)
def test_a_worker_that_leaves_an_executor_running_ends_as_a_program_would():
    from stratagem.testing.workers import run_workers

    assert [r.value for r in run_workers(executor_worker, 2, timeout=20)] == ["done", "done"]
