"""The fault matrix stays at zero: no hang, no silently wrong result, no data lost, no leak,
no unclear error (every case forked, with a hard timeout; one line per case is printed)."""

from __future__ import annotations

import pytest
from fault_matrix import CASES, GOOD, run


# in the slow tier (10-20 s; CI runs it): the main tier stays under 15 minutes
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_fault_matrix_reports_only_clear_errors_and_handled_faults(capsys):
    # the multi-process cases ("workers: ...") are tests of their own (tests/multiworker); the
    # script runs them too: python tests/faults/fault_matrix.py
    rows = run([n for n in CASES if not n.startswith("workers:")], timeout=60)
    with capsys.disabled():
        print()
        for row in rows:
            print(row)
    bad = [str(r) for r in rows if r.outcome not in GOOD]
    assert not bad, "\n".join(bad)
    assert len(rows) >= 15
