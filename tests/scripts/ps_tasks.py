"""Tiny tasks for `stratagem run --workers N --ps P` tests (no rpc): `ps_tasks.py MODE DIR`."""

import json
import os
import sys
import time
from pathlib import Path

mode, folder = sys.argv[1], Path(sys.argv[2])
task = json.loads(os.environ["TF_CONFIG"])["task"]
me = (task["type"], task["index"])
restart = int(os.environ["STRATAGEM_RESTART_COUNT"])


def wait_for(name, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not (folder / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"{name} did not appear within {timeout}s")
        time.sleep(0.05)


if mode == "print":  # every task says who it is, in one write (print's pieces may interleave with the others')
    sys.stdout.write("TASK " + json.dumps({"task": task, "restart": restart, "config": json.loads(os.environ["TF_CONFIG"]),
                                           "omp": os.environ.get("OMP_NUM_THREADS")}) + "\n")
    sys.stdout.flush()
elif mode == "restart":  # worker 1 fails on its first run; the chief ends once it is back
    if me == ("worker", 1):
        if restart == 0:
            sys.exit(3)
        (folder / f"worker1-restart{restart}").write_text("")
    if me == ("chief", 0):
        wait_for("worker1-restart1")
elif mode == "exhaust":  # worker 0 always fails; the chief ends after its last failure
    max_restarts = int(sys.argv[3])
    if me == ("worker", 0):
        (folder / f"worker0-run{restart}").write_text("")
        sys.exit(3)
    if me == ("chief", 0):
        wait_for(f"worker0-run{max_restarts}")
        time.sleep(2.0)  # the launcher sees that run's exit meanwhile
elif mode == "ps_fails":  # ps 0 fails while the others would run for a minute
    if me == ("ps", 0):
        time.sleep(0.5)
        sys.exit(5)
    time.sleep(60)
elif mode == "chief_fails":
    if me == ("chief", 0):
        time.sleep(0.5)
        sys.exit(7)
    time.sleep(60)
elif mode == "hang":  # the chief ends at once, worker 0 never does
    if me == ("worker", 0):
        time.sleep(1000)
elif mode == "sleep":  # every task says its pid and sleeps a minute
    from stratagem.core.procs import start_time

    # the pid and when it started: a pid can be another process's by the time it is checked
    # (written whole, then named: the test reads only complete files)
    (folder / f".pid-{me[0]}{me[1]}").write_text(f"{os.getpid()} {start_time(os.getpid())}")
    (folder / f".pid-{me[0]}{me[1]}").rename(folder / f"pid-{me[0]}{me[1]}")
    time.sleep(60)
else:
    sys.exit(f"unknown mode {mode}")
