"""Suite-wide settings: the tests' own helpers importable, and the ``multiprocess`` marker.

A test module that starts processes (the N-process harness, a launcher, a script run as a user
would) has its tests marked ``multiprocess``: `.ci/run` runs them a second time beside a CPU hog
(`scripts/stress_tier.sh`), so a test that only passes on an idle machine fails the session that
submits it, not the next user.
"""

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

#: what a module calls when its tests start processes
_STARTS_PROCESSES = re.compile(r"\b(run_workers|run_script|subprocess|Popen|launch)\(|\bsubprocess\.")


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test starts with the environment the session started with: a test (or code it
    calls in this process) that sets a variable does not change what later tests see."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    starts: dict[Path, bool] = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in starts:
            starts[path] = bool(_STARTS_PROCESSES.search(path.read_text()))
        if starts[path]:
            item.add_marker(pytest.mark.multiprocess)
