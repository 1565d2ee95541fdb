"""The README's example is examples/quickstart.py, and it runs cleanly (2 replicas, compiled step)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stratagem.testing import assert_clean_run, run_script

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_is_the_quickstart_file():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## The example\n\n<!-- program: examples/quickstart.py .*? -->\n```python\n(.*?)```", readme, re.S)
    assert block is not None
    assert block.group(1) in (ROOT / "examples" / "quickstart.py").read_text()


@pytest.mark.timeout(300)
def test_quickstart_runs():
    r = run_script([str(ROOT / "examples" / "quickstart.py")], timeout=280)
    assert_clean_run(r, what="examples/quickstart.py")  # eager and compiled parts: nothing on stderr
    assert re.fullmatch(r"loss \d+\.\d{4}", r.stdout.strip()), r.stdout
