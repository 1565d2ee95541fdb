"""Ctrl-C always works: a job stopped from outside (Ctrl-C at a terminal, `kill -INT`, `kill -TERM`)
ends every process it started within BOUND seconds (docs/MULTIWORKER.md, "Stopping a job"), in start-up, in training
(collectives, a checkpoint save) and in a pipeline's sends and receives.

Four fixed cases here; `scripts/interrupt_trials.py --trials 200` signals at random moments.
"""

from __future__ import annotations

import sys

import pytest

from stratagem.testing.interrupts import interrupt_job

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "scripts"))
from interrupt_trials import BOUND, job_argv, leftovers  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "mode,launcher,how,delay",
    [
        ("mirrored", "python", "ctrl-c", 1.5),  # while the replicas start
        ("mirrored", "python", "kill -INT", 9.0),  # training: collectives, checkpoint saves
        ("pipeline", "python", "kill -TERM", 9.0),  # a pipeline's sends and receives
        ("pipeline", "stratagem run", "ctrl-c", 9.0),  # torch's agent between the terminal and the job
    ],
)
def test_a_stopped_job_ends_every_process_within_the_bound(tmp_path, mode, launcher, how, delay):
    r = interrupt_job(job_argv(mode, launcher, str(tmp_path)), how, delay, BOUND)
    # the promise: every process of the job has ended BOUND s after the stop
    assert r.ok, f"{how} of {launcher} {mode}: {r.describe()}"
    # and a save it stopped left nothing half-written
    assert not leftovers(str(tmp_path)), leftovers(str(tmp_path))
