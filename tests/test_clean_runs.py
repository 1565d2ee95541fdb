"""Clean runs: what the docs show runs as written and prints nothing on stderr that the user did
not cause, on every replica; a failing run prints one clear error per rank.

The other documented programs are checked where they already run (share the runs): the README's
example (tests/test_examples.py), the demo (tests/test_demo.py), the tutorials
(tests/test_tutorials.py), all with ``assert_clean_run``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from stratagem.testing import (
    assert_clean_run,
    run_script,
    stderr_problems,
    stratagem_lines,
    tracebacks,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- (program|fragment): (.+?) -->\n```python\n")
SCRIPT = str(ROOT / "tests" / "scripts" / "mirrored_train.py")
#: torch's own log lines ("W1124 20:16:04.076000 4726 torch/...")
TORCH_LOG = re.compile(r"^(\[rank\d+\]:)?[WEI]\d{4} \d")


def _blocks() -> list[tuple[str, str, str | None, str | None]]:
    """(where, code, kind, reason) of every python block of the README and the docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            line = text[: m.start()].count("\n") + 1
            mark = MARK.search(text, max(0, m.start() - 300), m.start() + len("```python\n"))
            kind = reason = None
            if mark is not None and mark.end() == m.start() + len("```python\n"):
                kind, reason = mark.group(1), mark.group(2)
            found.append((f"{doc.relative_to(ROOT)}:{line}", m.group(1), kind, reason))
    return found


BLOCKS = _blocks()
PROGRAMS = [(where, code) for where, code, kind, _ in BLOCKS if kind is None]


def test_every_python_block_is_a_program_or_says_why_not():
    assert len(BLOCKS) >= 10
    for where, code, kind, reason in BLOCKS:
        if kind == "fragment":
            assert reason and len(reason) > 20, f"{where}: a fragment says what it needs and where it runs"
        elif kind == "program":
            file = ROOT / reason.split()[0]
            assert code in file.read_text(), f"{where}: the block is not, as written, in {file}"
    assert PROGRAMS, "no whole program found in the docs"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where,code", PROGRAMS, ids=[w for w, _ in PROGRAMS])
@pytest.mark.slow
def test_a_documented_program_runs_as_written_with_a_clean_stderr(where, code, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(code)
    r = run_script([str(script)], timeout=140, cwd=str(tmp_path))
    assert_clean_run(r, what=where)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stratagem_run_of_the_readme_example_is_clean(tmp_path):
    r = run_script(["-m", "stratagem", "run", "-n", "2", str(ROOT / "examples" / "quickstart.py")],
                   timeout=110, cwd=str(tmp_path), env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})  # fmt: skip
    assert_clean_run(r, what="stratagem run -n 2 examples/quickstart.py")
    assert not [ln for ln in r.stderr.splitlines() if TORCH_LOG.match(ln)], r.stderr
    assert re.fullmatch(r"loss \d+\.\d{4}", r.stdout.strip()), r.stdout  # once, by the chief


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_launch_from_python_c_is_clean():
    code = textwrap.dedent(
        """
        import torch, stratagem as sg

        def train():
            strategy = sg.MirroredStrategy("cpu", num_replicas=2)
            with strategy.scope():
                model = torch.nn.Linear(4, 1)
            return float(strategy.reduce("sum", strategy.run(lambda: model(torch.ones(2, 4)).sum())))

        print("RESULT", sg.launch(train, num_replicas=2, timeout=60))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=80)
    assert_clean_run(r, what="sg.launch from python -c")
    assert r.stdout.count("RESULT") == 1


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["demo", "--help"]])
def test_help_reads_as_plain_text(argv):
    r = subprocess.run([sys.executable, "-m", "stratagem", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "``" not in r.stdout and ":func:" not in r.stdout and ":class:" not in r.stdout, r.stdout
    assert r.stdout.startswith("usage: stratagem")


def test_the_problem_filter_needs_a_reason_and_sees_warnings():
    assert stderr_problems("x.py:3: FutureWarning: old\nfine\n") == ["x.py:3: FutureWarning: old"]
    assert stderr_problems("x.py:3: UserWarning: mine\n", allow=[("UserWarning: mine", "the user's own warn()")]) == []
    with pytest.raises(ValueError, match="needs a reason"):
        stderr_problems("", allow=[("x", " ")])


# --- failing runs: one clear error per rank ------------------------------------------------------
def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    # read until every process holding stderr (the replicas too) has ended
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # and a failed job leaves nothing in the temporary folder (torch's agent made a
    # /tmp/torchelastic_* on every `stratagem run`, and left it)
    with tempfile.TemporaryDirectory() as tmp:
        env["TMPDIR"] = tmp
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=100, env=env)
        left = [f for f in os.listdir(tmp) if not f.startswith("torchinductor_")]  # torch's cache, kept by design
        assert not left, f"left behind in TMPDIR: {left}\n{r.stderr}"
    return r


def _no_noise(stderr: str) -> None:
    assert "Exception ignored" not in stderr and "Warning" not in stderr, stderr
    assert not [ln for ln in stderr.splitlines() if TORCH_LOG.match(ln)], stderr  # torch's agent logs
    assert "GLHF" not in stderr and "pair.cc" not in stderr, stderr  # the backend's boilerplate


def _failing(flag: str, launch: str, rank: int) -> tuple[str, str, list[str]]:
    """Run the training script with ``flag rank``: (stderr, the other rank's lines, the launcher's)."""
    prefix = ["-m", "stratagem", "run", "-n", "2"] if launch != "self" else []
    r = _run([*prefix, SCRIPT, flag, str(rank)])
    assert r.returncode != 0
    _no_noise(r.stderr)
    lines = stratagem_lines(r.stderr)
    other = [ln for ln in lines if ln.startswith(f"stratagem: rank {1 - rank}:")]
    assert len(other) == 1 and len([ln for ln in lines if ln.startswith("stratagem: rank ")]) == 1, r.stderr
    return r.stderr, other[0], [ln for ln in lines if not ln.startswith("stratagem: rank ")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launch", ["self", "stratagem run"])
# rank 1 failing (the other side of the same report), in the slow tier, which the stress tier also
# runs beside a hog: the main tier under 15 minutes
@pytest.mark.parametrize("rank", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_raising_replica_gives_its_traceback_and_one_line_from_the_other(launch, rank):
    stderr, other, launcher = _failing("--fail-rank", launch, rank)
    assert tracebacks(stderr) == 1 and f"RuntimeError: boom on replica {rank}" in stderr, stderr
    # stopped by the agent or not, the other names the one that failed
    assert f"worker {rank} failed" in other, stderr
    assert launcher == ([] if launch == "self" else [f"stratagem run: replica {rank} failed (exit code 1)"]), stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launch", ["self", "stratagem run"])
# rank 1 failing (the other side of the same report), in the slow tier, which the stress tier also
# runs beside a hog: the main tier under 15 minutes
@pytest.mark.parametrize("rank", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_killed_replica_gives_one_line_from_the_other(launch, rank):
    stderr, other, launcher = _failing("--kill-rank", launch, rank)
    assert tracebacks(stderr) == 0, stderr
    if launch == "self" and rank == 0:  # rank 1 is stopped as its parent, rank 0, ends
        assert "stopped: rank 0" in other or "worker 0 failed" in other, stderr
    else:  # stopped by the agent or not, the other names the one that was killed
        assert f"worker {rank} failed" in other, stderr
    assert launcher == ([] if launch == "self" else [f"stratagem run: replica {rank} failed (exit code -9)"]), stderr


@pytest.mark.parametrize("follower", [0, 1])
def test_the_launcher_names_the_replica_the_other_followed_when_both_end_in_one_second(tmp_path, monkeypatch, follower):
    """torch's agent stamps a failure in whole seconds and breaks ties by rank; the replica that
    ended because the other failed says so in torch's error file, which torch's ProcessFailure
    reads and ``first_failure`` puts last."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from stratagem.cluster.stopping import first_failure, record_followed

    files = {r: str(tmp_path / f"error{r}.json") for r in (0, 1)}
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", files[follower])
    record_followed(f"WorkerFailedError: all_reduce failed because worker {1 - follower} failed", 1 - follower)
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=1, error_file=files[r]) for r in (0, 1)}
    assert "because worker" in str(failures[follower].message)
    for f in failures.values():
        f.timestamp = 1_700_000_000  # the same second
    assert first_failure(failures)[0] == 1 - follower
    # without the record, torch's rule: the earliest, then the lowest rank
    plain = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=1, error_file=str(tmp_path / "none")) for r in (0, 1)}
    plain[0].timestamp, plain[1].timestamp = 1_700_000_001, 1_700_000_000
    assert first_failure(plain)[0] == 1
    plain[0].timestamp = 1_700_000_000
    assert first_failure(plain)[0] == 0
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    record_followed("outside torch's agent: nothing is written", 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"error{follower}.json"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ending", ["raising", "clean"])
def test_a_replica_ending_on_its_own_exception_keeps_its_exit_code_through_the_launchers_sigterm(tmp_path, ending):
    """torch's agent SIGTERMs every replica once one has ended in failure; a replica that raised
    and whose peer followed it may still be in its last teardown then. It must end with its own
    exit code (1: `stratagem run: replica 0 failed (exit code 1)`), not be reported as killed by
    SIGTERM (-15); a replica ending cleanly is still ended by SIGTERM as by default."""
    here, go = tmp_path / "in-teardown", tmp_path / "go"
    script = tmp_path / "replica.py"
    script.write_text(textwrap.dedent(f"""
        import atexit, os, time

        def last():  # registered first, so it runs last: after the reporter is uninstalled
            open({str(here)!r}, "w").close()
            deadline = time.monotonic() + 30
            while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
                time.sleep(0.01)

        atexit.register(last)
        from stratagem.cluster.stopping import report_stops
        assert report_stops(0)
        if {ending == "raising"}:
            raise RuntimeError("boom on replica 0")
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 40
        while not here.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert here.exists(), f"the script did not reach its teardown (exit code {proc.poll()})"
        proc.send_signal(signal.SIGTERM)  # the launcher's, while the replica is in its teardown
        time.sleep(0.5)
        go.touch()
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    err = proc.stderr.read()
    if ending == "raising":
        assert code == 1 and tracebacks(err) == 1 and "RuntimeError: boom on replica 0" in err, (code, err)
    else:
        assert code == -signal.SIGTERM, (code, err)
