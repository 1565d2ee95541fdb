"""`stratagem run --workers N --ps P`: a chief, workers and ps tasks on this machine, each with its
TF_CONFIG; the chief's exit code; failing ps tasks end the job, failing workers are restarted;
nothing outlives the grace period. The tasks are tiny scripts (tests/scripts/ps_tasks.py, no rpc)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.cli.main import main as cli_main
from stratagem.core.procs import start_time
from stratagem.testing import run_script
from stratagem.testing.output import assert_clean_run, stratagem_lines, tracebacks

SCRIPT = str(Path(__file__).parent / "scripts" / "ps_tasks.py")


def launch(tmp_path, *options, mode, extra=(), timeout=60):
    return run_script(["-m", "stratagem", "run", *options, SCRIPT, mode, str(tmp_path), *extra], timeout=timeout)


@pytest.mark.timeout(90)
def test_every_task_gets_its_tf_config(tmp_path):
    r = launch(tmp_path, "--workers", "2", "--ps", "2", mode="print")
    assert_clean_run(r, what="stratagem run --workers 2 --ps 2")
    assert stratagem_lines(r.stderr) == []
    seen = [json.loads(line[len("TASK "):]) for line in r.stdout.splitlines() if line.startswith("TASK ")]
    tasks = sorted((s["task"]["type"], s["task"]["index"]) for s in seen)
    assert tasks == [("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
    clusters = {json.dumps(s["config"]["cluster"], sort_keys=True) for s in seen}
    assert len(clusters) == 1  # one cluster, the same for every task
    cluster = seen[0]["config"]["cluster"]
    assert [len(cluster[k]) for k in ("chief", "worker", "ps")] == [1, 2, 2]
    addresses = [a for k in ("chief", "worker", "ps") for a in cluster[k]]
    assert len(set(addresses)) == 5 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert {s["restart"] for s in seen} == {0}
    assert all(s["omp"] for s in seen)  # set for the tasks when the user did not


@pytest.mark.timeout(90)
def test_failed_worker_is_restarted_with_the_next_restart_count(tmp_path):
    r = launch(tmp_path, "--workers", "2", "--ps", "1", "--max-restarts", "3", mode="restart")
    assert r.returncode == 0, r.stderr
    assert stratagem_lines(r.stderr) == ["stratagem run: worker 1 failed (exit code 3); restarting it (1 of 3)"]
    assert (tmp_path / "worker1-restart1").exists() and tracebacks(r.stderr) == 0


@pytest.mark.slow  # the out-of-restarts case stays in the main tier; this one in the slow tier (CI runs it): the main tier under 15 minutes
@pytest.mark.timeout(90)
def test_failed_worker_is_not_restarted_by_default(tmp_path):
    """As torchrun: no restarts unless asked for (--max-restarts N; a restarted worker rejoins,
    tests/ps); the job goes on without it (the chief runs its functions elsewhere)."""
    r = launch(tmp_path, "--workers", "2", "--ps", "1", mode="exhaust", extra=["0"])
    assert r.returncode == 0, r.stderr
    assert stratagem_lines(r.stderr) == [
        "stratagem run: worker 0 failed (exit code 3); not restarting it (0 of 0 restarts used), "
        "the job goes on without it"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker0-run0"]


@pytest.mark.timeout(90)
def test_worker_out_of_restarts_is_left_out_and_the_job_goes_on(tmp_path):
    r = launch(tmp_path, "--workers", "2", "--ps", "1", "--max-restarts", "2", mode="exhaust", extra=["2"])
    assert r.returncode == 0, r.stderr
    assert stratagem_lines(r.stderr) == [
        "stratagem run: worker 0 failed (exit code 3); restarting it (1 of 2)",
        "stratagem run: worker 0 failed (exit code 3); restarting it (2 of 2)",
        "stratagem run: worker 0 failed (exit code 3); not restarting it (2 of 2 restarts used), "
        "the job goes on without it",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker0-run0", "worker0-run1", "worker0-run2"]


@pytest.mark.timeout(90)
def test_failed_ps_ends_the_job(tmp_path):
    start = time.monotonic()
    r = launch(tmp_path, "--workers", "2", "--ps", "2", "--grace-period", "2", mode="ps_fails")
    assert r.returncode == 1, r.stderr
    assert stratagem_lines(r.stderr) == ["stratagem run: ps 0 failed (exit code 5)"]
    assert tracebacks(r.stderr) == 0  # the others were stopped quietly
    assert time.monotonic() - start < 30  # promise: a failed ps stops the others at once (not their 60 s sleep)


@pytest.mark.timeout(90)
def test_failed_chief_is_the_exit_code_and_stops_the_others(tmp_path):
    start = time.monotonic()
    r = launch(tmp_path, "--workers", "1", "--ps", "1", mode="chief_fails")
    assert r.returncode == 7, r.stderr
    # tasks that do not leave when the chief fails (these sleep) are stopped 3 s later, each named
    assert stratagem_lines(r.stderr) == [
        "stratagem run: chief failed (exit code 7)",
        "stratagem run: worker 0 was still running 3s after the chief failed; stopping it",
        "stratagem run: ps 0 was still running 3s after the chief failed; stopping it",
    ]
    assert time.monotonic() - start < 30  # promise: a failed chief stops the others at once (not their 60 s sleep)


@pytest.mark.timeout(90)
def test_task_still_running_after_the_grace_period_is_stopped(tmp_path):
    start = time.monotonic()
    r = launch(tmp_path, "--workers", "2", "--ps", "1", "--grace-period", "1", mode="hang")
    assert r.returncode == 0, r.stderr  # the chief's
    assert stratagem_lines(r.stderr) == [
        "stratagem run: worker 0 was still running 1s after the chief exited; stopping it"
    ]
    assert time.monotonic() - start < 30  # promise: the 1 s grace period, then SIGTERM, SIGKILL 5 s later


@pytest.mark.parametrize(
    "argv,message",
    [
        (["-n", "2", "--workers", "2", "--ps", "1"], "cannot be combined with --workers/--ps"),
        (["--workers", "2"], "needs both --workers N and --ps P, got --workers 2 --ps None"),
        (["--workers", "0", "--ps", "1"], "needs --workers >= 1 and --ps >= 1, got --workers 0 --ps 1"),
        (["--workers", "1", "--ps", "1", "--nnodes", "2"], "--nnodes, --node-rank"),
        (["--workers", "1", "--ps", "1", "--grace-period", "-1"], "--grace-period must be >= 0"),
        (["--workers", "1", "--ps", "1", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["-n", "2", "--grace-period", "5"], "--grace-period applies to a parameter-server cluster"),
        (["--workers", "1", "--ps", "1", "--", "missing.py"], "no such script: 'missing.py'"),
    ],
)
def test_option_errors(argv, message, capsys):
    assert cli_main(["run", *argv, SCRIPT]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stratagem run: ") and message in err and err.count("\n") == 1


@pytest.mark.timeout(90)
def test_terminated_launcher_stops_every_task(tmp_path):
    cmd = [sys.executable, "-m", "stratagem", "run", "--workers", "2", "--ps", "1", SCRIPT, "sleep", str(tmp_path)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("pid-*"))) < 4:
            assert time.monotonic() < deadline and launcher.poll() is None, "the tasks did not start"
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert stratagem_lines(err) == [] and tracebacks(err) == 0
    for pid_file in tmp_path.glob("pid-*"):
        # stopped and reaped by the launcher: no process of that pid started when the task did (on
        # a busy machine a pid comes round again within seconds: pid_max is 32768 here, and every
        # thread takes one; a zombie would still be the task)
        pid, started = pid_file.read_text().split()
        assert start_time(int(pid)) != started, f"{pid_file.name} (pid {pid}) is still there"
