"""The fault matrix (issue 31), every case a test: a job started as a user would start it is
broken one way (a rank raises, is SIGKILLed or SIGSTOPped; a host's link is cut or slowed; a
host vanishes; a worker never comes; a checkpoint save is cut off) under MirroredStrategy,
MultiWorkerMirroredStrategy, ShardedStrategy, PipelineStrategy and ParameterServerStrategy, on
one host and on hosts of their own (network namespaces; those cases skip where they cannot be
made). Each must end every process within its bound (2 s on one host, 10 s across hosts; the
chief goes on without a lost worker under ParameterServerStrategy), every other rank naming the
right peer, nothing left behind, no checkpoint lost (tests/faults/matrix.py judges).

A run of every case, with the one-process matrix (tests/faults/fault_matrix.py: the mistakes a
user makes, cluster descriptions that cannot work, the readers of untrusted bytes fuzzed; every
case forked with its bound), writes the one table docs/MULTIWORKER.md shows, between its matrix
markers (tests/faults/matrix_table.py); a partial run (-k, a skip) leaves it as it is, or writes
what ran to $MATRIX_TABLE_OUT when that is set.
The matrix tier: `bash scripts/test.sh --matrix` (CI runs it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import fault_matrix
import matrix_table
import pytest
from matrix import CASES, Row, cells, run

from stratagem.testing import hosts as hosts_mod

_rows: dict[str, Row] = {}
_one_process: list[fault_matrix.Row] = []
_one_process_seconds: list[float] = []


def _id(name: str) -> str:
    return name.replace(": ", "-").replace(" ", "_")


@pytest.fixture(scope="module", autouse=True)
def _write_table():
    yield
    full = len(_rows) == len(CASES) and len(_one_process) == len(fault_matrix.CASES)
    out = os.environ.get("MATRIX_TABLE_OUT")
    if not full and not out:
        return  # a partial run (-k, a skip) leaves the table of the last full run
    mp = [cells(_rows[c.name]) for c in CASES if c.name in _rows]
    op = [matrix_table.one_process_cells(r) for r in _one_process]
    stamp = f"{matrix_table.machine()}, `bash scripts/test.sh --matrix`"
    op_stamp = f"{stamp} ({len(op)} cases, every one forked, in {sum(_one_process_seconds):.0f} s)"
    body = matrix_table.render(stamp, mp, op_stamp, op)
    if full:
        matrix_table.write(body)
    else:  # what ran, for a look at the table a partial run would write
        Path(out).write_text(f"{matrix_table.START}\n{body}\n{matrix_table.END}\n")


@pytest.mark.matrix
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[_id(c.name) for c in CASES])
def test_every_process_ends_within_its_bound_naming_the_failed_one(case):
    if case.hosts and hosts_mod.unavailable():
        pytest.skip(hosts_mod.unavailable())
    row = run(case)
    _rows[case.name] = row
    assert row.outcome == "ok", f"{row}\n{row.detail}"


# the one-process matrix runs here, in the matrix tier only (CI runs it once)
@pytest.mark.matrix
@pytest.mark.timeout(300)
def test_every_mistake_is_a_clear_error_or_handled_within_its_bound(capsys):
    start = time.monotonic()
    rows = fault_matrix.run()
    _one_process_seconds.append(time.monotonic() - start)
    _one_process.extend(rows)
    with capsys.disabled():
        print()
        for row in rows:
            print(row)
        print(fault_matrix.summary(rows), f"in {_one_process_seconds[0]:.0f} s")
    bad = [str(r) for r in rows if r.outcome not in fault_matrix.GOOD]
    assert not bad, "\n".join(bad)
    assert len(rows) == len(fault_matrix.CASES) >= 131
