"""A replica stopped with SIGSTOP (it runs no code, holds its sockets open, and its pid is alive)
ends the job within 2 s on one host: its peer sees the stopped state, says so in one line, and
ends the stopped process, so nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.testing.interrupts import JobProcesses

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_stopped_replica_ends_the_job_within_2s_and_is_not_left_behind():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(HERE / "stopped_replica_job.py")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    job = JobProcesses(proc.pid)
    line = proc.stdout.readline()
    stopped_at = time.monotonic()
    assert line.startswith("STOP"), line
    assert len(job.alive()) == 2  # the script and the replica it started
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - stopped_at
    assert proc.returncode == 1, err
    assert took < 2.0, f"the job ended {took:.1f} s after the replica stopped\n{err}"  # the promise
    assert "worker 1 failed: its process" in err and "is stopped (SIGSTOP)" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    deadline = time.monotonic() + 5
    while job.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not job.alive()  # the stopped replica was ended too
