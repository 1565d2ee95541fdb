"""A stop of the ``stratagem`` command that Python or torch loses still ends it, and its replicas.

A Ctrl-C can vanish before any of our code could act on it: ``import torch`` swallows a
KeyboardInterrupt raised while it runs (9 of 40 SIGINTs sent during the import here: the import
finishes and the program runs on), and torch's agent (torchrun, under ``stratagem run``) turns
SIGINT and SIGTERM into ``SignalException``, an ``Exception`` that its own ``except Exception``
blocks can catch. Either way the job runs on, silently; the replicas, in sessions of their own,
never saw the Ctrl-C.

So the command's process listens from its first line (``stratagem/__init__.py``, before torch is
imported, and only when it is the ``stratagem`` command: see :func:`guard_command`) with Python's
signal wakeup descriptor, which the C handler writes whatever becomes of the exception. A thread
that reads a stop signal there waits :data:`GRACE_S` for the process to end by itself, as it does
when the signal is handled, and otherwise stops every process it started (SIGTERM to each one's
process group, SIGKILL to what is left :data:`KILL_AFTER_S` later) and ends it with 128 + the
signal, after one line saying so. The command releases the guard where its own stopping takes
over (``stratagem demo``'s replicas, the parameter-server launcher). Linux only (children are read
from ``/proc``); installed only where nothing else owns the wakeup descriptor, and only by the
main thread. Imports nothing but the standard library.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

#: seconds the agent has to end by itself after a stop signal
GRACE_S = 2.0
#: seconds between SIGTERM and SIGKILL of the processes the agent started
KILL_AFTER_S = 1.0

_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def children(pid: int | None = None) -> list[int]:
    """The live processes whose parent is ``pid`` (this process by default), from ``/proc``."""
    parent = os.getpid() if pid is None else pid
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry))
    return found


def stop_children(kill_after: float = KILL_AFTER_S) -> None:
    """SIGTERM every child (its whole process group where it leads one: a replica and what it
    started), then SIGKILL what is left ``kill_after`` seconds later."""
    own = os.getpgrp()

    def signal_all(sig: signal.Signals) -> list[int]:
        alive = children()
        for pid in alive:
            try:
                if os.getpgid(pid) == pid and pid != own:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        return alive

    if not signal_all(signal.SIGTERM):
        return
    deadline = time.monotonic() + kill_after
    while time.monotonic() < deadline and children():
        time.sleep(0.05)
    signal_all(signal.SIGKILL)


_release: list[Callable[[], None]] = []
_at_end: list[Callable[[], None]] = []


def at_end(fn: Callable[[], None]) -> None:
    """Run ``fn`` (removing the command's scratch files, say) if the guard ends the command: its
    ``finally`` blocks do not run then."""
    _at_end.append(fn)


def is_command() -> bool:
    """Whether this process is the ``stratagem`` command (the console script, ``python -m
    stratagem`` or ``python -m stratagem.cli.main``), not a program that imports stratagem."""
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1] in ("stratagem", "stratagem.cli.main")
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == "stratagem"


def guard_command() -> None:
    """Install the guard if this process is the ``stratagem`` command (see the module's docstring)."""
    if is_command():
        guard()


def release() -> None:
    """Stop listening (the command's own stopping takes over, or it is ending). Idempotent."""
    while _release:
        _release.pop()()


def open_doorbell() -> tuple[socket.socket, socket.socket] | None:
    """(bell, ring): a socket pair whose ``ring`` end is Python's signal wakeup descriptor (the C
    handler writes each signal's number there, from whatever thread it interrupts); read
    ``bell``. None where someone else (an event loop) already listens there, or it cannot be set."""
    bell, ring = socket.socketpair()
    ring.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(ring.fileno(), warn_on_full_buffer=False)
    except ValueError:
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)  # leave it to them
        bell.close()
        ring.close()
        return None
    return bell, ring


def guard(grace: float = GRACE_S) -> bool:
    """Listen for stop signals (see the module's docstring); idempotent. Returns whether the
    guard is installed."""
    if _release:
        return True
    if threading.current_thread() is not threading.main_thread() or not sys.platform.startswith("linux"):
        return False
    pair = open_doorbell()
    if pair is None:
        return False
    bell, ring = pair
    done = threading.Event()

    def watch() -> None:
        with bell:
            while True:
                try:
                    rung = bell.recv(64)
                except OSError:
                    return
                if not rung or done.is_set():
                    return
                stops = [s for s in _STOPS if s in rung]
                if stops:
                    if not done.wait(grace):
                        _end(stops[0], grace)
                    return

    thread = threading.Thread(target=watch, name="stratagem-stop-guard", daemon=True)
    thread.start()

    def stop() -> None:
        done.set()
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass
        ring.close()  # the watcher reads the end of the stream and returns
        thread.join(timeout=1.0)

    _release.append(stop)
    return True


def _end(sig: signal.Signals, grace: float) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.write(
            f"stratagem: the command did not stop within {grace:g}s of {sig.name}; "
            "stopping it and its replicas\n"
        )
        sys.stderr.flush()
        stop_children()
        for fn in _at_end:
            try:
                fn()
            except Exception:  # noqa: BLE001 - ending the command matters more than tidying up
                pass
    finally:
        os._exit(128 + int(sig))
