"""Restarts in a row: `stratagem run -n 2 --max-restarts K` of a job whose worker 1 crashes
(os._exit) right after each attempt formed its process group and reduced, until the last attempt,
optionally beside a CPU hog (`--hog`: one busy process per core). Every attempt must form its
group (each under its own prefix of the agent's store) within the bound of the one before, the
job must exit 0, and nothing of it may be left running.
`python scripts/restart_trials.py --restarts 200 --hog`. Exit status 1 on any miss.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multiworker"))
from test_restarts import _SCRIPT  # noqa: E402 - the test's job, as the test runs it

#: each attempt forms its group within this many seconds of the one before (issue 53)
BOUND = 30.0


def _hog() -> None:  # pragma: no cover - a busy loop in a child process
    while True:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--hog", action="store_true", help="one busy process per core beside the job")
    args = ap.parse_args()
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(os.cpu_count() or 1)] if args.hog else []
    for h in hogs:
        h.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "crash.py"
            script.write_text(_SCRIPT)
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
            began = time.monotonic()
            r = subprocess.run([sys.executable, "-m", "stratagem", "run", "-n", "2", "--max-restarts",
                                str(args.restarts), str(script), tmp, str(args.restarts)],
                               env=env, capture_output=True, text=True)  # fmt: skip
            took = time.monotonic() - began
            lines = [line.split() for line in (Path(tmp) / "rank0").read_text().splitlines()]
            attempts = [int(a) for a, _, _ in lines]
            stamps = [float(t) for _, t, _ in lines]
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout.split()
    finally:
        for h in hogs:
            h.kill()
    ok = r.returncode == 0 and attempts == list(range(args.restarts + 1)) and max(gaps, default=0) < BOUND and not left
    gaps.sort()
    print(f"{args.restarts} restarts{' beside a CPU hog' if hogs else ''}: exit {r.returncode}, "
          f"{len(attempts)} attempts formed, restart gap median {gaps[len(gaps) // 2] if gaps else 0:.1f} s, "
          f"max {max(gaps, default=0):.1f} s (bound {BOUND:.0f} s), {took:.0f} s in all, left running: {left or 'none'}")
    if not ok:
        print(r.stderr[-3000:])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
