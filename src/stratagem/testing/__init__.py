"""stratagem.testing: a testing utility, for tests only (stratagem's own suite and yours).

Reusable contracts (distributed == single device, exact resume) and a harness that runs a
function as N processes with a hard timeout. It ships in the wheel so that users can test their
own distributed programs the way stratagem tests itself; training code should not import it
(nothing outside this package does). The names exported here are the supported ones; the
submodules (zygote, scale, cost_probe, ...) are the suite's internals and may change."""

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
