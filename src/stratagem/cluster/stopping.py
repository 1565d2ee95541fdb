"""Say, in one line, why a replica stops when it is told to (SIGTERM), even while it is blocked.

A replica is stopped from outside in two ways: torch's agent (``stratagem run``, torchrun) sends
SIGTERM to every replica once one has failed, and a replica that ``python train.py`` started
gets SIGTERM when that process (rank 0) ends (``PR_SET_PDEATHSIG``). By default SIGTERM ends the
process without a word, and a Python handler would run only when the main thread leaves the
collective it may be blocked in. So Python's own C-level handler is used as a doorbell: it writes
the signal's number to a socket (``signal.set_wakeup_fd``) from whatever thread it interrupts, and
a small thread here reads it, waits a moment for the replica's own report (a failure it is
already raising says more), then prints one line and ends the process with 143 (128 + SIGTERM),
the exit code the default action gives.

The same doorbell rings for Ctrl-C (SIGINT). Python raises KeyboardInterrupt in the main thread
only when it runs Python code again; a replica blocked in a call that does not return (a
collective whose peer was stopped, forming the process group with a peer that is gone) would sit
there until that call's timeout. So if the SIGINT handler has not run
:data:`INTERRUPT_GRACE_S` after the bell, this thread prints one line and ends the process with
130 (128 + SIGINT), as the shell's Ctrl-C would have.

Installed only where nothing else handles SIGTERM or owns the wakeup descriptor (a user's
handler, an asyncio loop), and only by the main thread.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from stratagem.core import finalizers, stop_guard

#: how long the main thread has to start handling Ctrl-C before the process is ended
INTERRUPT_GRACE_S = 1.5

_reported = threading.Event()
_installed: list[object] = []
#: what this process knows, without asking anyone, of a peer that failed: (rank, why) or None
Explainer = Callable[[], "tuple[int | None, str] | None"]
_explainers: list[Explainer] = []


def explain_stops_with(explainer: Explainer | None) -> None:
    """A SIGTERM's line names the replica that failed when ``explainer`` knows it (the failure
    monitor, which sees a local peer's process gone at once): the launcher often stops the
    others before their own watcher has looked. ``None`` removes it."""
    _explainers[:] = [] if explainer is None else [explainer]


def _known_failure() -> tuple[int | None, str] | None:
    explainers = list(_explainers)  # the one set now, if any
    try:
        return explainers[0]() if explainers else None
    except Exception:  # noqa: BLE001 - an explanation is a courtesy; the stop goes on
        return None


def mark_reported() -> None:
    """This process has said why it ends (a traceback, a one-line failure): nothing more to add."""
    _reported.set()


def reported() -> bool:
    """Whether this process has already said why it ends."""
    return _reported.is_set()


#: the key of torch's error file that says a replica ended because another failed
FOLLOWED = "stratagem_followed_rank"


def record_followed(message: str, rank: int | None) -> None:
    """This replica ends because replica ``rank`` (None: unknown) failed or the launcher stopped it:
    say so in the error file torch's agent reads (``TORCHELASTIC_ERROR_FILE``, in the format of
    torch.distributed.elastic's ``ErrorHandler``), so that ``stratagem run`` names the replica
    that failed first (``first_failure``). Nothing happens outside torch's agent."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {"message": message, "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}},
        FOLLOWED: rank,
    }
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:  # the launcher then names a replica by its exit time alone
        pass


def first_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """Of the failed replicas (rank -> torch's ``ProcessFailure``), the one the others followed:
    first those that did not record that they followed another, then the earliest. torch's own
    ``get_first_failure`` takes the earliest alone, in whole seconds with ties going to the lowest
    rank: a replica that failed and one that ended a moment later because of it are often tied."""

    def key(item: tuple[int, Any]) -> tuple[bool, int, int]:
        rank, failure = item
        data = getattr(failure, "error_file_data", None)
        return (isinstance(data, dict) and FOLLOWED in data, int(failure.timestamp), rank)

    return min(failures.items(), key=key)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """SIGTERM seen by the main thread: the watcher thread acts on it."""


def report_stops(rank: int, *, parent_pid: int | None = None, wait_for_report: float = 0.5) -> bool:
    """From now on a SIGTERM prints ``stratagem: rank R: stopped ...`` once and ends the process.

    ``parent_pid``: the rank-0 process that started this one (self-launched replicas); the line
    then says that it ended. ``wait_for_report``: seconds to wait after a SIGTERM for a report
    the replica is already making (an exception it raises says more than the line); short, since
    every process of a stopped job must end within seconds. Returns whether the reporter was
    installed (once per process).
    """
    if _installed or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False  # the program handles SIGTERM itself (e.g. to checkpoint on preemption)
    pair = stop_guard.open_doorbell()
    if pair is None:
        return False
    bell, ring = pair
    signal.signal(signal.SIGTERM, _ignore)
    finalizers.install_interrupt_handler()  # notes when the main thread handled a Ctrl-C
    thread = threading.Thread(
        target=_watch, args=(bell, rank, parent_pid, wait_for_report), name="stratagem-stop-reporter", daemon=True
    )
    thread.start()
    _installed.append(thread)

    def uninstall() -> None:
        # at exit, in the main thread: hand SIGTERM back, wake the watcher so it returns. A
        # replica ending on its own exception (its traceback is out) ignores SIGTERM from here
        # on and ends with its own exit code: torch's agent stops every replica once a peer
        # that followed this one has ended, and that SIGTERM, in the last moments of this
        # process's exit, made `stratagem run` report the replica that raised as "exit code
        # -15" (seen beside a busy machine). Python's exit keeps an ignored signal ignored.
        try:
            signal.set_wakeup_fd(-1)
            failing = getattr(sys, "last_value", None) is not None
            signal.signal(signal.SIGTERM, signal.SIG_IGN if failing else signal.SIG_DFL)
        except ValueError:
            pass
        ring.close()
        thread.join(timeout=1.0)
        _skip_the_last_collection_if_failed()

    atexit.register(uninstall)
    return True


def _skip_the_last_collection_if_failed() -> None:
    """A replica ending on Ctrl-C or on an exception (its own, or one saying a peer failed)
    skips the full garbage collection Python runs as it finalizes (over a torch program's heap,
    a second of CPU on a busy machine, while every process of a stopped or failed job must end
    within seconds, and a peer learns of this one's failure when its connections close, at its
    exit): every object left is frozen, so that collection finds nothing to scan. Objects in
    reference cycles are then not finalized, as at a SIGKILL; what must be written at exit is
    written by exit handlers, which have run by now."""
    if getattr(sys, "last_value", None) is not None:
        gc.freeze()


def _watch(bell: socket.socket, rank: int, parent_pid: int | None, wait_for_report: float) -> None:
    handled = False
    with bell:  # read until uninstalled at exit, so that the doorbell is never a broken pipe
        while True:
            try:
                rung = bell.recv(64)
            except OSError:
                return
            if not rung:
                return
            if signal.SIGINT in rung and finalizers.handles_interrupts():  # not a handler of the user's
                _watch_interrupt(rank)
            if signal.SIGTERM in rung and not handled:  # act on the first SIGTERM
                handled = True
                _stop(rank, parent_pid, wait_for_report)


#: the SIGINT handler's run count when the last Ctrl-C was known to be handled
_handled_runs = [0]


def _watch_interrupt(rank: int) -> None:
    """Ctrl-C rang: end the process if the main thread has not handled it within the grace.

    Handled means the handler ran after the previous Ctrl-C was seen handled: it may have run
    already, before this thread read the bell (the main thread is not blocked then), so the
    count of its runs is compared, never the time this thread happened to read the bell at."""
    before = _handled_runs[0]

    def handled() -> bool:
        runs = finalizers.handler_runs()
        if runs > before:
            _handled_runs[0] = max(_handled_runs[0], runs)
            return True
        return False

    if handled():
        return

    def check() -> None:
        if handled():
            return  # KeyboardInterrupt was raised (or deferred past a finalizer): it is ending
        try:
            sys.stdout.flush()
            sys.stderr.write(
                f"stratagem: rank {rank}: interrupted (Ctrl-C) while blocked in a call that did not "
                f"return within {INTERRUPT_GRACE_S:g}s; ending it\n"
            )
            sys.stderr.flush()
            record_followed("interrupted (Ctrl-C)", None)
        finally:
            os._exit(128 + signal.SIGINT)

    timer = threading.Timer(INTERRUPT_GRACE_S, check)
    timer.daemon = True
    timer.start()


def _stop(rank: int, parent_pid: int | None, wait_for_report: float) -> None:
    if _reported.wait(wait_for_report):
        # the replica is already ending with its own explanation; SIGTERM's default would
        # have ended it at once, so do not let it run on for long
        stop = threading.Timer(10.0, os._exit, args=(143,))
        stop.daemon = True
        stop.start()
        return
    followed: int | None = None
    known = _known_failure()
    if parent_pid is not None and os.getppid() != parent_pid:
        line = f"stopped: rank 0 (pid {parent_pid}), which started this replica, ended"
    elif known is not None:
        followed, why = known
        who = "a worker" if followed is None else f"worker {followed}"
        line = f"stopped by SIGTERM: {who} failed: {why} (the launcher stops every replica when one fails)"
    else:
        line = "stopped by SIGTERM (the launcher stops every replica when one fails, or the job was stopped)"
    try:
        sys.stdout.flush()
        sys.stderr.write(f"stratagem: rank {rank}: {line}\n")
        sys.stderr.flush()
        record_followed(line, followed)
    finally:
        os._exit(143)
