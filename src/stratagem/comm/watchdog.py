"""The watchdog's rules: which collectives are under way, and when a process a failure left blocked is ended."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

#: exit code of a process the watchdog stops because a peer failed while it was blocked.
ABORT_EXIT_CODE = 1
#: how long a process blocked in a collective, once a peer's failure is known, is given for the
#: collective to fail on its own (a reset from the peer, raised as WorkerFailedError) before the
#: watchdog stops it: a peer's connections can stay open after it failed (its process lives on
#: while it reports, and torch does not always close a destroyed gloo group's connections)
RESET_WAIT_S = 0.3

#: the collectives this process is inside now (any thread), entered at what time
_in_collectives: dict[int, float] = {}
_in_collectives_lock = threading.Lock()
_collective_ids = itertools.count()


@contextlib.contextmanager
def in_collective() -> Iterator[None]:
    """Marks a collective (or send/recv) under way: once a peer is known to have failed, a
    process waiting in one is stopped after one heartbeat, not after the grace meant for a
    process still computing (which can raise the error itself at its next collective)."""
    with _in_collectives_lock:
        key = next(_collective_ids)
        _in_collectives[key] = time.monotonic()
    try:
        yield
    finally:
        with _in_collectives_lock:
            _in_collectives.pop(key, None)


#: how many waits that may give up (``ProcessGroupCommunicator._wait``) are under way
_giving_up = [0]


@contextlib.contextmanager
def giving_up_allowed() -> Iterator[None]:
    """Marks a wait that gives up by itself once a peer is known lost."""
    _giving_up[0] += 1
    try:
        yield
    finally:
        _giving_up[0] -= 1


def waiting_can_give_up() -> bool:
    """Whether the collective under way gives up by itself on a lost peer (the watchdog then
    need not stop the process)."""
    return _giving_up[0] > 0


def waiting_in_collective_since() -> float | None:
    with _in_collectives_lock:
        return min(_in_collectives.values(), default=None)


def abort_due_in(
    *,
    silent: bool,
    continues: bool,
    failure_age: float,
    grace: float,
    probing_for: float | None,
    probe_bound: float,
) -> float | None:
    """Seconds until a process that knows of a failure is ended (<= 0: now; None: it is not).

    ``continues``: the job goes on without the failed rank; ``failure_age``: since the failure
    became known; ``probing_for``: how long the main thread has been explaining a failed
    collective (None: it is not)."""
    blocked = waiting_in_collective_since() is not None
    if continues and (not silent or not blocked or waiting_can_give_up()):
        # the main thread's collective fails (a reset; or, for a silent peer, its wait gives up
        # by itself), and the survivors go on without it. A silent peer while the main thread
        # waits where it cannot give up: stopped as without "continue"
        return None
    if probing_for is not None and probing_for < probe_bound:
        return probe_bound - probing_for  # the main thread is about to raise itself
    # a silent peer was already waited for (dead_after_seconds): no collective with it can
    # finish, so there is nothing to give the main thread time for
    wait = 0.0 if silent else grace
    if blocked:
        # blocked in a collective: it cannot finish with a failed peer, and no error may come
        # (the peer's connections open): a moment for a reset to arrive and be raised, then
        # the process is stopped
        wait = min(wait, RESET_WAIT_S)
    return wait - failure_age
