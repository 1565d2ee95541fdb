"""`stratagem run` keeps torch's agent files in one scratch folder of its own and removes it at the
end. A launcher killed with SIGKILL cannot; the next launcher removes the folders of launchers that
are gone, and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.cli.run import SCRATCH_PREFIX, sweep_scratch


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # reaped: no process has it (until the kernel hands it out again, far later)


def _folder(tmp: Path, name: str, age_s: float) -> Path:
    d = tmp / name
    (d / "agent").mkdir(parents=True)
    (d / "agent" / "log").write_text("x")
    then = time.time() - age_s
    os.utime(d, (then, then))
    return d


def test_only_old_folders_of_launchers_that_are_gone_are_removed(tmp_path):
    dead = _dead_pid()
    gone = _folder(tmp_path, f"{SCRATCH_PREFIX}{dead}-abc", 3600)
    fresh = _folder(tmp_path, f"{SCRATCH_PREFIX}{dead}-new", 5)  # its replicas may still write there
    live = _folder(tmp_path, f"{SCRATCH_PREFIX}{os.getpid()}-def", 3600)
    unnamed = _folder(tmp_path, f"{SCRATCH_PREFIX}x1y2z3", 3600)  # not ours to judge
    other = _folder(tmp_path, f"elsewhere-{dead}-abc", 3600)
    huge = _folder(tmp_path, f"{SCRATCH_PREFIX}{10**30}-big", 3600)  # no such pid (nor a C int)
    assert sorted(sweep_scratch(str(tmp_path))) == sorted([str(gone), str(huge)])
    assert not gone.exists() and not huge.exists()
    assert fresh.exists() and live.exists() and unnamed.exists() and other.exists()


def test_a_missing_temporary_directory_is_no_error(tmp_path):
    assert sweep_scratch(str(tmp_path / "absent")) == []


@pytest.mark.slow  # two launches: in the slow tier (CI runs it), the main tier under 15 minutes
@pytest.mark.timeout(120)
def test_a_sigkilled_launcher_s_folder_goes_at_the_next_launch(tmp_path):
    """A real launcher, SIGKILLed while its replica runs: its folder stays; the next `stratagem run`
    (once the folder is a minute old) removes it and leaves nothing of its own."""
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["TMPDIR"] = str(tmp)
    launcher = subprocess.Popen([sys.executable, "-m", "stratagem", "run", "-n", "1", str(script)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not any(n.startswith(SCRATCH_PREFIX) for n in os.listdir(tmp)):
            assert launcher.poll() is None and time.monotonic() < deadline, "the launcher made no scratch folder"
            time.sleep(0.1)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and its replica, nothing runs at exit
        launcher.wait()
    left = [n for n in os.listdir(tmp) if n.startswith(SCRATCH_PREFIX)]
    assert left == [f for f in left if f.startswith(f"{SCRATCH_PREFIX}{launcher.pid}-")] and len(left) == 1
    then = time.time() - 120
    os.utime(tmp / left[0], (then, then))
    script.write_text("print('ok')\n")
    r = subprocess.run([sys.executable, "-m", "stratagem", "run", "-n", "1", str(script)], env=env,
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert [n for n in os.listdir(tmp) if not n.startswith("torchinductor_")] == []
