"""The README's examples are examples/quickstart.py and examples/keras_way.py, and they run cleanly
(2 replicas each)."""

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


# in the slow tier (10-20 s; CI runs it): the main tier stays under 15 minutes
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_runs():
    r = run_script([str(ROOT / "examples" / "quickstart.py")], timeout=280)
    assert_clean_run(r, what="examples/quickstart.py")  # eager and compiled parts: nothing on stderr
    assert re.fullmatch(r"loss \d+\.\d{4}", r.stdout.strip()), r.stdout


def test_readme_keras_example_is_the_keras_way_file():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- program: examples/keras_way.py .*? -->\n```python\n(.*?)```", readme, re.S)
    assert block is not None
    assert block.group(1) == (ROOT / "examples" / "keras_way.py").read_text()


# in the slow tier (10-20 s; CI runs it): the main tier stays under 15 minutes
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras_way_runs(tmp_path):
    r = run_script([str(ROOT / "examples" / "keras_way.py")], timeout=280, cwd=str(tmp_path))
    assert_clean_run(r, what="examples/keras_way.py")
    m = re.fullmatch(r"val_accuracy (\d\.\d{3}) accuracy (\d\.\d{3}) predict \(3, 10\)", r.stdout.strip())
    assert m is not None, r.stdout  # printed once (by the chief), not once per replica
    assert float(m.group(2)) > 0.8  # 5 epochs of Adam on the digits (parity: tests/train/test_keras_model.py)
    import zipfile

    saved = tmp_path / "digits_model.keras"  # one file, and what load_model reads back
    assert "config.json" in zipfile.ZipFile(saved).namelist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits_model.keras"]
