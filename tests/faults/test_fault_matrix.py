"""The one-process fault matrix's own judge (the matrix itself runs in the matrix tier, in
tests/faults/test_matrix.py): a case past its bound is a hang and is killed, another class or
missing words are an unclear error, no error where one is due is silent, a process left behind
is a leak; and the one table merges the multi-process rows with the one-process ones, a partial
run writing nothing into docs/MULTIWORKER.md."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import fault_matrix
import matrix_table
import pytest
from matrix_kit import Registry, Spec


def _hang(d: Path) -> str:
    time.sleep(60)
    return "never"


def _leaky(d: Path) -> str:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    return "started a process and left it"


R = Registry()


@R.error("wrong class", ValueError, "needle")
def _(d: Path) -> object:
    raise KeyError("needle")


@R.error("missing words", ValueError, "needle")
def _(d: Path) -> object:
    raise ValueError("something else")


@R.error("no error", ValueError, "needle")
def _(d: Path) -> object:
    return 1


@R.error("the error", ValueError, "needle")
def _(d: Path) -> object:
    raise ValueError("the needle")


JUDGED = {s.name: s for s in [
    Spec("hang", _hang, "ok: returns", bound=1.5),
    Spec("leak", _leaky, "ok: returns"),
    *R.specs,
]}  # fmt: skip


@pytest.mark.timeout(60)
def test_each_bad_outcome_is_named_and_a_hang_is_ended_at_its_bound():
    start = time.monotonic()
    rows = {r.case: r for r in fault_matrix.run(cases=JUDGED, jobs=6)}
    assert time.monotonic() - start < 15
    assert {k: r.outcome for k, r in rows.items()} == {
        "hang": "hang", "leak": "leak", "wrong class": "unclear error", "missing words": "unclear error",
        "no error": "silent wrong", "the error": "clear error",
    }  # fmt: skip
    assert 1.5 <= rows["hang"].seconds < 4
    assert (
        "KeyError" in rows["wrong class"].detail
        and "expected ValueError" in rows["wrong class"].detail
    )
    assert "does not say ['needle']" in rows["missing words"].detail


def test_the_matrix_has_its_cases_each_with_an_expectation_and_a_bound():
    cases = fault_matrix.CASES
    assert len(cases) >= 131  # with the 69 multi-process cases: >= 200
    for name, spec in cases.items():
        assert spec.name == name and spec.bound > 0 and spec.expect, name
        assert (
            spec.expect.startswith("ok") or spec.expect_class and spec.expect_class[0].isupper()
        ), name
    fuzz = [n for n in cases if n.startswith("fuzz:")]
    assert any("Example" in n for n in fuzz) and any("TFRecord" in n for n in fuzz)
    assert any("checkpoint" in n for n in fuzz)


def _doc(tmp_path: Path) -> Path:
    doc = tmp_path / "MULTIWORKER.md"
    doc.write_text(matrix_table.DOC.read_text())
    return doc


def test_the_one_table_merges_both_matrices_with_its_totals(tmp_path, monkeypatch):
    from matrix import CASES, Row

    doc = _doc(tmp_path)
    mp = [Row(CASES[0], "ok", {"worker 0": 0.3, "worker 1": 0.2}, {"worker 1": "WorkerFailedError: worker 0 failed"}),
          Row(CASES[1], "hang", {"worker 0": None})]  # fmt: skip
    mp_cells = [__import__("matrix").cells(r) for r in mp]
    op = [fault_matrix.Row("data: batch(0)", "clear error", "ValueError: batch | size", "ValueError 'batch'", 15.0, 0.2),
          fault_matrix.Row("fuzz: x", "silent wrong", "no error", "ok: y", 15.0, 0.1)]  # fmt: skip
    body = matrix_table.render(
        "a full run", mp_cells, "today", [matrix_table.one_process_cells(r) for r in op]
    )
    matrix_table.write(body, doc)
    text = doc.read_text()
    assert (
        "**4 cases** (2 multi-process, 2 one-process): 2 as expected; 1 hangs, 1 silent results, 0 leftover"
        in text
    )
    assert (
        "| data: batch(0) | ValueError 'batch' | 15 s | 0.20 s | clear error | `ValueError: batch \\| size` |"
        in text
    )
    assert text.count(matrix_table.START) == 1 and text.count(matrix_table.END) == 1
    # read back: the same rows, the multi-process ones told from the one-process ones
    stamp, mp_back, op_back = matrix_table.read(doc)
    assert stamp == "a full run" and [c.case for c in mp_back] == [CASES[0].name, CASES[1].name]
    assert [c.case for c in op_back] == ["data: batch(0)", "fuzz: x"] and op_back[
        0
    ].message.endswith("size`")


@pytest.mark.timeout(120)
def test_a_run_of_the_matrix_tier_that_selects_nothing_leaves_the_table(tmp_path):
    before = matrix_table.DOC.read_text()
    out = tmp_path / "table.md"
    env = {**os.environ, "MATRIX_TABLE_OUT": str(out)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "matrix",
                        str(Path(__file__).parent / "test_matrix.py"), "-k", "the_matrix_tier_never_matches"],
                       capture_output=True, text=True, env=env, timeout=110)  # fmt: skip
    assert r.returncode == 5, r.stdout[-2000:]  # nothing selected: nothing run
    assert matrix_table.DOC.read_text() == before
    assert not out.exists()  # no test of the module ran: its writer did not either
