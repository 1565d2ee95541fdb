"""Exit is orderly: nothing of torch.distributed runs into interpreter finalization.

A thread woken inside a C++ call (a gloo worker, the store's server, the failure watcher in a
store call) after the interpreter began to finalize is ended by ``pthread_exit``, whose unwinding
calls ``std::terminate``: "terminate called without an active exception", exit code 134, after
the program's work is done. ``distribute.join._leave`` tears the process group, the failure
monitor and the store down at exit, in order, while the interpreter is whole.
"""

from __future__ import annotations

import re

import pytest
from mw_workers import leave_worker

from stratagem.testing import run_workers

pytestmark = pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs /proc")


def _threads(stderr: str) -> tuple[list[str], list[str]]:
    m = re.search(r"THREADS-AT-EXIT python=(\[.*?\]) native=(\[.*?\])", stderr)
    assert m, stderr[-2000:]
    return eval(m.group(1)), eval(m.group(2))  # noqa: S307 - our own repr of two lists of str


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["ok", "compile", "tensor_parallel", "raise"])
def test_nothing_of_torch_distributed_outlives_exit(how):
    results = run_workers(leave_worker, 2, args=(how,), timeout=90, check=False)
    for r in results:
        assert r.returncode == (1 if how == "raise" else 0), r.stderr[-2000:]
        assert "terminate called" not in r.stderr
        python, native = _threads(r.stderr)
        assert python == [], python  # the failure watcher was joined
        left = [n for n in native if n.startswith(("gloo", "pt_gloo", "pt_tcpstore"))]
        assert left == [], f"rank {r.rank}: threads of torch.distributed still running at exit: {left}"
