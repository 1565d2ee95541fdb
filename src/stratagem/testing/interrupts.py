"""Stop a job from outside (Ctrl-C, ``kill -INT``, ``kill -TERM``) and check that every process it
started has ended within a bound: the contract behind "Ctrl-C always works".

A job runs in its own session (as a command started from a terminal is its own process group);
its processes are found through ``/proc`` by that session, so replicas a launcher or the script
itself started are counted, whoever their parent is. Linux only.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: how a job is stopped: the signal, and whether it goes to the whole process group (a terminal's
#: Ctrl-C) or to the process that was started only (``kill``)
STOPS: dict[str, tuple[signal.Signals, bool]] = {
    "ctrl-c": (signal.SIGINT, True),
    "kill -INT": (signal.SIGINT, False),
    "kill -TERM": (signal.SIGTERM, False),
}


@dataclass
class Interrupted:
    """What happened to a job stopped ``delay`` seconds after it started."""

    ok: bool  # every process ended within the bound
    seconds: float  # from the signal until the last process ended (or the bound)
    left: list[tuple[int, str]]  # (pid, command line) of those still running at the bound
    stderr: str
    ended_early: bool  # the job had ended by itself before the signal

    def describe(self) -> str:
        if self.ended_early:
            return "the job ended by itself before the signal:\n" + self.stderr[-2000:]
        return "still running: " + "; ".join(f"{p} {c}" for p, c in self.left) + "\n" + self.stderr[-3000:]


def session_processes(sid: int) -> list[tuple[int, str]]:
    """Live (not zombie) processes of session ``sid``: (pid, command line)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
                found.append((int(entry), cmd.strip()))
        except (OSError, IndexError, ValueError):
            continue
    return found


def interrupt_job(
    argv: Sequence[str], how: str, delay: float, bound: float, *, env: Mapping[str, str] | None = None,
) -> Interrupted:
    """Start ``argv`` in a session of its own, stop it as ``how`` says (a key of :data:`STOPS`)
    after ``delay`` seconds, and wait at most ``bound`` seconds for every process of the session
    to end. Whatever is left is then killed (after a ``py-spy dump`` of each, where installed)."""
    sig, group = STOPS[how]
    proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ if env is None else env))
    try:
        time.sleep(delay)
        if proc.poll() is not None:
            return Interrupted(False, 0.0, [], proc.communicate()[1], True)
        signalled = time.monotonic()
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        left = session_processes(proc.pid)
        while left and time.monotonic() - signalled < bound:
            time.sleep(0.02)
            proc.poll()
            left = session_processes(proc.pid)
        took = time.monotonic() - signalled
        dumps = ""
        if left and shutil.which("py-spy"):  # what each one was doing
            for pid, _ in left:
                dump = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True, text=True)
                dumps += f"\n--- py-spy dump {pid}\n{dump.stdout[-3000:]}"
    finally:
        if proc.poll() is None or session_processes(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        err = ""
    return Interrupted(not left, took, left, err + dumps, False)
