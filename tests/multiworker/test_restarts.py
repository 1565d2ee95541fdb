"""`stratagem run --max-restarts K` (torch elastic's restarts): every attempt forms its process
group under a prefix of its own in the agent's store (which outlives a restart), so no attempt
reads the addresses of the one before it; each attempt recovers, and nothing is left running."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

_SCRIPT = '''
import os, sys, time
import torch
import stratagem as sg
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
strategy = sg.MultiWorkerMirroredStrategy(devices="cpu")
total = strategy.reduce("sum", torch.ones(3) * (attempt + 1))
rank = int(os.environ["RANK"])
with open(os.path.join(sys.argv[1], f"rank{rank}"), "a") as f:
    f.write(f"{attempt} {time.time():.3f} {float(total[0])}\\n")
if attempt < int(sys.argv[2]) and rank == 1:
    os._exit(3)  # a crash after the group formed: torch's agent starts every worker again
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_restart_forms_a_fresh_group_and_recovers(tmp_path):
    restarts = 4
    script = tmp_path / "crash.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    began = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "stratagem", "run", "-n", "2", "--max-restarts", str(restarts),
                        str(script), str(tmp_path), str(restarts)],
                       env=env, capture_output=True, text=True, timeout=200)  # fmt: skip
    took = time.monotonic() - began
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        lines = [line.split() for line in (tmp_path / f"rank{rank}").read_text().splitlines()]
        # every attempt formed its group and reduced (before it, attempts 2+ read stale gloo
        # addresses: "Connection refused", and the job failed)
        assert [int(a) for a, _, _ in lines] == list(range(restarts + 1)), lines
        assert [float(v) for _, _, v in lines] == [2.0 * (a + 1) for a in range(restarts + 1)]
        stamps = [float(t) for _, t, _ in lines]
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        assert max(gaps) < 30, gaps  # each restart recovered within 30 s
    assert "Connection refused" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"left running after {took:.0f}s: {left.stdout}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_never_outlives_its_launcher(tmp_path):
    """torch's agent SIGKILLed while its workers run: the workers end within seconds (the kernel's
    SIGTERM at their parent's death), instead of running on, holding their devices."""
    script = tmp_path / "wait.py"
    script.write_text("import time, torch, stratagem as sg\n"
                      "s = sg.MultiWorkerMirroredStrategy(devices='cpu')\n"
                      "s.reduce('sum', torch.ones(1))\nprint('ready', flush=True)\ntime.sleep(90)\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        launcher = subprocess.Popen([sys.executable, "-m", "stratagem", "run", "-n", "2", str(script)], env=env,
                                    stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while out.read_text().count("ready") < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, out.read_text()[-3000:]
            time.sleep(0.2)
        workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 2, workers
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        while any(os.path.exists(f"/proc/{w}") and _alive(w) for w in workers):
            assert time.monotonic() - killed < 10, f"workers {workers} outlived their launcher by 10 s"
            time.sleep(0.1)
    finally:
        launcher.kill()
        subprocess.run(["pkill", "-9", "-f", str(script)])


def _alive(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
