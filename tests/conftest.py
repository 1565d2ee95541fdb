"""Suite-wide settings: the tests' own helpers importable, and the ``multiprocess`` marker.

A test module that starts processes (the N-process harness, a launcher, a script run as a user
would) has its tests marked ``multiprocess``. The multi-process tests whose outcome depends on
timing (a failure, a stuck peer or a signal must reach every process within a bound; output must
stay clean while processes end at different moments) are also marked ``stress``: `.ci/run` runs
them a second time beside a CPU hog (`scripts/stress_tier.sh`; those of the slow tier only when
asked), so a test that only passes on an
idle machine fails the session that submits it, not the next user. (All the multi-process tests
beside a hog take about 23 minutes here: `bash scripts/stress_tier.sh -m "multiprocess and not
slow"` runs them all.)
"""

import os
import re
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

#: what a module calls when its tests start processes
_STARTS_PROCESSES = re.compile(r"\b(run_workers|run_script|subprocess|Popen|launch)\(|\bsubprocess\.")


def pytest_configure(config: pytest.Config) -> None:
    # Started in the background by a non-interactive shell (`bash scripts/test.sh &`, nohup), pytest
    # inherits SIGINT ignored, and so would every job a test starts and then interrupts (Python
    # installs its KeyboardInterrupt handler only where SIGINT is at its default): the Ctrl-C tests
    # need the job to start as it would from a terminal. A handled signal is reset to its default
    # in a child at exec; an ignored one stays ignored.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, lambda *_: None)  # a handler, so children start at the default


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test starts with the environment the session started with: a test (or code it
    calls in this process) that sets a variable does not change what later tests see."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


#: the stress tier: test files, each with a pattern its test names must match (None: all of them)
STRESS: dict[str, re.Pattern[str] | None] = {
    "tests/faults/test_interrupts.py": None,
    "tests/faults/test_loud.py": None,
    "tests/multiworker/test_failures.py": None,
    "tests/multiworker/test_exit.py": None,
    "tests/data/test_engine_cleanup.py": None,
    # the replicas that raise, die or follow one another, not the documented programs (no failure in them)
    "tests/test_clean_runs.py": re.compile(r"raising|killed|follow|launch_from"),
    "tests/checkpoint/test_ownership.py": None,
    "tests/faults/test_stopped_replica.py": None,
    "tests/data/test_engine_batch_workers.py": re.compile(r"autotune"),
    "tests/test_mirrored.py": re.compile(r"stuck|fail|raise|kill|timeout|hang"),
    "tests/pipeline/test_pipeline_training.py": re.compile(r"failure|exception"),
    # five tasks writing to one stdout: their lines interleaved under load
    "tests/test_ps_launch.py": re.compile(r"every_task_gets"),
}


def _stress(path: Path, name: str) -> bool:
    rel = path.relative_to(Path(__file__).parent.parent).as_posix()
    if rel not in STRESS:
        return False
    pattern = STRESS[rel]
    return pattern is None or bool(pattern.search(name))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    starts: dict[Path, bool] = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in starts:
            starts[path] = bool(_STARTS_PROCESSES.search(path.read_text()))
        if starts[path]:
            item.add_marker(pytest.mark.multiprocess)
            if _stress(path, item.name):
                item.add_marker(pytest.mark.stress)
