"""The fault matrix (issue 31), every case a test: a job started as a user would start it is
broken one way (a rank raises, is SIGKILLed or SIGSTOPped; a host's link is cut or slowed; a
host vanishes; a worker never comes; a checkpoint save is cut off) under MirroredStrategy,
MultiWorkerMirroredStrategy, ShardedStrategy, PipelineStrategy and ParameterServerStrategy, on
one host and on hosts of their own (network namespaces; those cases skip where they cannot be
made). Each must end every process within its bound (2 s on one host, 10 s across hosts; the
chief goes on without a lost worker under ParameterServerStrategy), every other rank naming the
right peer, nothing left behind, no checkpoint lost (tests/faults/matrix.py judges).

A run of every case writes the table docs/MULTIWORKER.md shows, between its matrix markers.
The matrix tier: `bash scripts/test.sh --matrix` (CI runs it)."""

from __future__ import annotations

import datetime
import os
import platform

import pytest
from matrix import CASES, REPO, Row, run, table

from stratagem.testing import hosts as hosts_mod

DOC = REPO / "docs" / "MULTIWORKER.md"
START = "<!-- fault matrix: start (tests/faults/test_matrix.py writes this table after a run of every case) -->"
END = "<!-- fault matrix: end -->"
_rows: dict[str, Row] = {}


def _id(name: str) -> str:
    return name.replace(": ", "-").replace(" ", "_")


@pytest.fixture(scope="module", autouse=True)
def _write_table():
    yield
    if len(_rows) < len(CASES):
        return  # a partial run (-k, a skip) leaves the table of the last full run
    text = DOC.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    rows = [_rows[c.name] for c in CASES]
    ok = sum(r.outcome == "ok" for r in rows)
    stamp = (f"{ok} of {len(rows)} cases ok; {datetime.date.today().isoformat()}, "
             f"{platform.machine()} with {os.cpu_count()} cores, `bash scripts/test.sh --matrix`")
    DOC.write_text(f"{head}{START}\n{stamp}\n\n{table(rows)}\n{END}{tail}")


@pytest.mark.matrix
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[_id(c.name) for c in CASES])
def test_every_process_ends_within_its_bound_naming_the_failed_one(case):
    if case.hosts and hosts_mod.unavailable():
        pytest.skip(hosts_mod.unavailable())
    row = run(case)
    _rows[case.name] = row
    assert row.outcome == "ok", f"{row}\n{row.detail}"
