"""Stress the rejoin of a restarted parameter-server worker: many rejoins in a row, counting crashes.

Runs ``stratagem run --workers 2 --ps 2 --max-restarts R tests/ps/ps_train.py rejoin_many sgd R``
``--jobs`` times: in each job worker 1 dies in its third function R times in a row, and each time
the chief takes the dead process out of the rpc group and admits the restarted one, while worker 0
trains on. A job counts as crashed when a task ends by a signal (e.g. ``exit code -11``, a
segfault; each task runs with PYTHONFAULTHANDLER=1, so it prints its threads' Python stacks), when
the job fails, or when it does not finish. ``--mode rejoin`` runs the test's own scenario (one
rejoin per job) instead.

    .venv/bin/python scripts/ps_rejoin_stress.py --jobs 3 --rejoins 20
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "ps" / "ps_train.py"
SIGNALLED = re.compile(r"stratagem run: (\w+ \d+) failed \(exit code (-\d+)\)")
REJOINED = "restarted and rejoined; it runs functions again"


def job(mode: str, rejoins: int, timeout: float) -> tuple[bool, int, str]:
    """One job: (crashed, rejoins seen, what went wrong)."""
    restarts = 1 if mode == "rejoin" else rejoins
    argv = [
        sys.executable, "-m", "stratagem", "run", "--workers", "2", "--ps", "2", "--max-restarts", str(restarts),
        "--grace-period", "20", str(SCRIPT), mode, "sgd", str(rejoins),
    ]  # fmt: skip
    try:
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a crashed task prints its threads' stacks
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return True, err.count(REJOINED), f"did not finish within {timeout:g}s\n{err[-3000:]}"
    seen = r.stderr.count(REJOINED)
    signalled = SIGNALLED.findall(r.stderr)
    if signalled or r.returncode != 0 or seen < restarts:
        what = ", ".join(f"{task} exit code {code}" for task, code in signalled) or f"exit code {r.returncode}"
        return True, seen, f"{what}; {seen} of {restarts} rejoins\n{r.stderr[-8000:]}"
    return False, seen, ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=3, help="jobs run one after another")
    p.add_argument("--rejoins", type=int, default=20, help="rejoins per job (mode rejoin_many)")
    p.add_argument("--mode", choices=["rejoin_many", "rejoin"], default="rejoin_many")
    p.add_argument("--timeout", type=float, default=0, help="seconds per job (default: 60 + 15 per rejoin)")
    args = p.parse_args()
    timeout = args.timeout or 60 + 15 * (1 if args.mode == "rejoin" else args.rejoins)
    crashed = rejoined = 0
    start = time.monotonic()
    for i in range(args.jobs):
        t0 = time.monotonic()
        bad, seen, what = job(args.mode, args.rejoins, timeout)
        crashed += bad
        rejoined += seen
        print(f"job {i + 1}/{args.jobs}: {'CRASHED' if bad else 'ok'}, {seen} rejoins, {time.monotonic() - t0:.0f}s", flush=True)
        if bad:
            print(what, flush=True)
    print(
        f"SUMMARY jobs={args.jobs} crashed={crashed} rejoins={rejoined} mode={args.mode} "
        f"seconds={time.monotonic() - start:.0f}",
        flush=True,
    )
    sys.exit(1 if crashed else 0)


if __name__ == "__main__":
    main()
