"""Stop a job from outside (Ctrl-C, ``kill -INT``, ``kill -TERM``) and check that every process it
started has ended within a bound: the contract behind "Ctrl-C always works".

A job runs in its own session (as a command started from a terminal is its own process group).
Its processes are every descendant of the process started, followed through ``/proc`` from before
the stop until the last has ended, so a replica in a session of its own (torch's agent starts each
worker with ``start_new_session``) or re-parented after its parent ended is still counted (a pid
is known by its start time too: a reused pid is not mistaken for it). Linux only.
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
    dumps: str = ""  # what each process left was doing (py-spy, where installed)
    ended: dict[int, float] | None = None  # pid -> seconds from the signal until it was seen ended

    def describe(self) -> str:
        if self.ended_early:
            return "the job ended by itself before the signal:\n" + self.stderr[-2000:]
        ended = ", ".join(f"{pid} after {s:.2f}s" for pid, s in sorted((self.ended or {}).items(), key=lambda i: i[1]))
        return ("still running: " + "; ".join(f"{p} {c}" for p, c in self.left) + "\n"
                + (f"ended: {ended}\n" if ended else "") + self.stderr[-4000:] + self.dumps)


def _table() -> dict[int, tuple[int, int, str, str]]:
    """Every process: pid -> (parent pid, start time, state, command line)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
            table[int(entry)] = (int(fields[1]), int(fields[19]), fields[0], cmd.strip())
        except (OSError, IndexError, ValueError):
            continue
    return table


class JobProcesses:
    """The processes of the job rooted at ``root``: its descendants, remembered once seen."""

    def __init__(self, root: int) -> None:
        self.known: dict[int, tuple[int, str]] = {}  # pid -> (start time, command line)
        self.root = root

    def alive(self) -> list[tuple[int, str]]:
        """(pid, command line) of the job's live (not zombie) processes, newly started ones
        (children of a known one) included."""
        table = _table()
        grew = True
        while grew:
            grew = False
            for pid, (ppid, start, _, cmd) in table.items():
                if pid not in self.known and (ppid == self.root or ppid in self.known or pid == self.root):
                    self.known[pid] = (start, cmd)
                    grew = True
        return [(pid, cmd) for pid, (start, cmd) in self.known.items()
                if pid in table and table[pid][1] == start and table[pid][2] != "Z"]


def as_from_a_terminal() -> None:
    """For ``Popen(preexec_fn=...)``: the stop signals at their defaults in the job, as in a command
    typed at a terminal. A process started in the background by a non-interactive shell (``cmd &``
    in a script, ``nohup``) inherits SIGINT and SIGQUIT *ignored*, and so would every process it
    starts: Python then installs no KeyboardInterrupt handler and a Ctrl-C test could only fail."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def interrupt_job(
    argv: Sequence[str], how: str, delay: float, bound: float, *, env: Mapping[str, str] | None = None,
    after: str | os.PathLike[str] | None = None, after_timeout: float = 120.0,
) -> Interrupted:
    """Start ``argv`` in a session of its own, stop it as ``how`` says (a key of :data:`STOPS`)
    after ``delay`` seconds, and wait at most ``bound`` seconds for every process of the session
    to end. Whatever is left is then killed (after a ``py-spy dump`` of each, where installed).
    With ``after`` (a file the job writes when it reaches a point, e.g. its imports done), the
    delay counts from when that file appears (at most ``after_timeout`` s): a moment of the job's
    own progress, the same on a busy machine as on an idle one."""
    sig, group = STOPS[how]
    proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ if env is None else env),
                            preexec_fn=as_from_a_terminal)
    job = JobProcesses(proc.pid)
    try:
        if after is not None:
            give_up = time.monotonic() + after_timeout
            while not os.path.exists(after) and proc.poll() is None and time.monotonic() < give_up:
                job.alive()
                time.sleep(0.02)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:  # learn the job's processes as they start
            job.alive()
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if proc.poll() is not None:
            return Interrupted(False, 0.0, [], proc.communicate()[1], True)
        job.alive()
        signalled = time.monotonic()
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        left = job.alive()
        ended: dict[int, float] = {}
        while left and time.monotonic() - signalled < bound:
            time.sleep(0.02)
            proc.poll()
            before, left = left, job.alive()
            now = time.monotonic() - signalled
            ended.update((pid, now) for pid, _ in before if pid not in dict(left))
        took = time.monotonic() - signalled
        dumps = ""
        if left and shutil.which("py-spy"):  # what each one was doing
            for pid, _ in left:
                dump = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True, text=True)
                dumps += f"\n--- py-spy dump {pid}\n{dump.stdout[-3000:]}{dump.stderr[-1000:]}"
    finally:
        for pid, _ in job.alive():  # whatever is left, in whichever session
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        err = ""
    return Interrupted(not left, took, left, err, False, dumps, ended)
