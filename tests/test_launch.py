"""Process launch: a plain `python train.py`, torchrun joining, output once (failing runs:
tests/test_clean_runs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stratagem.testing import run_script

SCRIPT = str(Path(__file__).parent / "scripts" / "mirrored_train.py")


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_plain_python_script_starts_its_own_replicas():
    r = run_script([SCRIPT], timeout=100)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("DONE")]
    assert len(lines) == 1, r.stdout  # printed once, by the chief
    assert "world=2" in lines[0] and "launcher=self" in lines[0]


# in the slow tier (10-20 s; CI runs it): the main tier stays under 15 minutes
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torchrun_launched_script_joins_the_group():
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT], timeout=100)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("DONE")]
    assert len(lines) == 1 and "world=2" in lines[0] and "launcher=torchrun" in lines[0]
    # same training, same result as the self-launched job
    r2 = run_script([SCRIPT], timeout=100)
    assert lines[0].split()[2] == [ln for ln in r2.stdout.splitlines() if ln.startswith("DONE")][0].split()[2]


def test_interactive_session_cannot_self_launch():
    r = run_script(["-c", "import stratagem as sg; sg.MirroredStrategy(devices='cpu', num_replicas=2)"], timeout=60)
    assert r.returncode != 0
    assert "stratagem run -n N script.py" in r.stderr
    assert sys.executable
