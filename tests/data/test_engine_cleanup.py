"""Plain scripts (no __main__ guard) run the process engines; killing the job by SIGTERM,
SIGINT or SIGKILL (main process or whole group) leaves no worker, segment or semaphore."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import faulthandler, multiprocessing, signal, sys
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks if it hangs
    from stratagem.data import Dataset

    def work(x):  # pure Python: holds the GIL
        total = 0
        for i in range(2000):
            total = (total * 31 + i) % 1000003
        return total + x

    batches = Dataset.range(N).map(work, num_parallel_calls=2, use_processes=True).batch(4)
    elements = Dataset.range(N).map(work, num_parallel_calls=2, use_processes=True)
    a, b = iter(batches), iter(elements)
    first = next(a).tolist(), next(b)
    pids = [p.pid for p in multiprocessing.active_children()]
    print("PIDS", *pids, flush=True)
    if N < 1000:
        print("SUM", sum(int(x) for batch in a for x in batch) + sum(first[0]), flush=True)
    else:
        while True:
            next(a), next(b)
""")


def _run(tmp_path: Path, n: int, **kw) -> subprocess.Popen:
    script = tmp_path / "plain_script.py"  # deliberately without `if __name__ == "__main__":`
    script.write_text(SCRIPT.replace("N)", f"{n})").replace("N <", f"{n} <"))
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds nothing
    except FileNotFoundError:
        return False


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.timeout(60)
def test_script_without_main_guard_runs_process_engines(tmp_path):
    proc = _run(tmp_path, 40)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 0, err[-3000:]
    assert "bootstrapping" not in err

    def work(x):
        total = 0
        for i in range(2000):
            total = (total * 31 + i) % 1000003
        return total + x

    assert f"SUM {sum(work(x) for x in range(40))}" in out


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process engine")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL", "group SIGKILL"])
def test_nothing_survives_a_killed_job_by_more_than_5s(tmp_path, how):
    before = _shm()
    proc = _run(tmp_path, 10**7, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), (line, proc.stderr.read()[-3000:] if proc.poll() else "")
        workers = [int(p) for p in line.split()[1:]]
        assert len(workers) >= 4  # two batch workers, two pool workers
        time.sleep(0.3)
        sig = signal.SIGKILL if "KILL" in how else getattr(signal, how)
        if how.startswith("group"):
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        killed = time.monotonic()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # the job's stacks, for the report
            time.sleep(1.0)
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            raise AssertionError(f"{how}: the job did not end within 30 s; its threads:\n{err[-6000:]}") from None
        while time.monotonic() - killed < 5 and any(_alive(p) for p in workers):
            time.sleep(0.05)
        left = [p for p in workers if _alive(p)]
        assert not left, f"{how}: workers {left} outlived the job by 5 s"
        assert not (_shm() - before), f"{how}: left in /dev/shm: {_shm() - before}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
