"""stratagem.testing: reusable contracts (distributed == single device, exact resume) and a
harness that runs a function as N processes with a hard timeout."""

from stratagem.testing.contracts import (
    assert_matches_single_device,
    assert_replicas_identical,
    train_reference,
)
from stratagem.testing.output import assert_clean_run, stderr_problems, stratagem_lines, tracebacks
from stratagem.testing.workers import WorkerResult, run_script, run_workers

__all__ = [
    "WorkerResult",
    "assert_clean_run",
    "assert_matches_single_device",
    "assert_replicas_identical",
    "run_script",
    "run_workers",
    "stderr_problems",
    "stratagem_lines",
    "train_reference",
    "tracebacks",
]
