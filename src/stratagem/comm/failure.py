"""Failure detection: heartbeats and failure records in the job's store, and a watchdog.

Every process of a job runs one ``FailureMonitor`` thread with its own connection to the
rendezvous store. It bumps a heartbeat counter, and watches its peers: a failure record
(written by a rank whose program raised, with its traceback), a local peer whose process is
gone, a remote peer whose heartbeat stopped for ``dead_after_seconds``, or a store that stopped
answering (rank 0, which hosts it, is gone). ``probe`` explains a failed collective with what the
monitor knows, so ``WorkerFailedError`` names the rank. A gloo collective cannot be interrupted
from another thread: when a failure is known and the main thread has not raised within
``grace_seconds``, the watchdog prints the error and ends the process with exit code 1.

Tracebacks are printed once: the rank that raised prints its own; the others print one line.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import json
import multiprocessing
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch.distributed as dist

from stratagem.cluster.launch import children
from stratagem.cluster.stopping import explain_stops_with, mark_reported, record_followed
from stratagem.comm.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    WorkerFailedError,
    looks_like_peer_loss,
)
from stratagem.comm.interfaces import route_source
from stratagem.core.procs import pid_alive, pid_stopped

#: exit code of a process the watchdog stops because a peer failed while it was blocked.
ABORT_EXIT_CODE = 1
#: how long a process blocked in a collective, once a peer's failure is known, is given for the
#: collective to fail on its own (a reset from the peer, raised as WorkerFailedError) before the
#: watchdog stops it: a peer's connections can stay open after it failed (its process lives on
#: while it reports, and torch does not always close a destroyed gloo group's connections)
RESET_WAIT_S = 0.3
#: a store call's error that says the store's process is gone (not merely silent)
_RESET = re.compile(r"reset by peer|broken pipe|connection refused|\beof\b|connection was likely closed", re.I)

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


def _waiting_in_collective_since() -> float | None:
    with _in_collectives_lock:
        return min(_in_collectives.values(), default=None)


@dataclass(frozen=True)
class FailureOptions:
    """How failures are detected. A peer that falls silent (a remote machine that vanished, a
    network cut between hosts: no heartbeat from it, or no answer from the store for
    ``dead_after_seconds``) ends every process within about ``dead_after_seconds + 2 *
    heartbeat_seconds``: a collective with a silent peer can never finish, so there is no grace.
    A local process that died, or a rank that raised, within about ``heartbeat_seconds +
    grace_seconds`` (the grace lets a rank computing between collectives raise the error itself).

    ``on_failure``: ``"raise"`` (the default) ends every process with that clear error;
    ``"continue"`` (MirroredStrategy, MultiWorkerMirroredStrategy, under ``fit``) keeps the job
    running when a replica's process dies, raises, is stopped or falls silent (a host cut off):
    the survivors agree on who is left, form a new process group over themselves and go on with
    the same global batch (``distribute/failover.py``). The replica hosting the job's store
    (rank 0, or the chief) cannot be lost.
    ``max_restarts`` (with ``"continue"``): a replica that MirroredStrategy started itself and that
    is lost is started again, up to this many times in all; the new process is let in between two
    training steps and takes the training state from a live peer (a cluster manager that starts a
    lost TF_CONFIG worker again gets the same).
    """

    heartbeat_seconds: float = 1.0
    dead_after_seconds: float = 6.0
    grace_seconds: float = 5.0
    enabled: bool = True
    on_failure: str = "raise"
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.heartbeat_seconds <= 0 or self.dead_after_seconds <= self.heartbeat_seconds:
            raise ValueError(
                f"FailureOptions: need 0 < heartbeat_seconds < dead_after_seconds, got "
                f"{self.heartbeat_seconds} and {self.dead_after_seconds}"
            )
        if self.grace_seconds < 0:
            raise ValueError(f"FailureOptions: grace_seconds must be >= 0, got {self.grace_seconds}")
        if self.on_failure not in ("raise", "continue"):
            raise ValueError(f"FailureOptions: on_failure must be 'raise' or 'continue', got {self.on_failure!r}")
        if self.max_restarts < 0 or (self.max_restarts and self.on_failure != "continue"):
            raise ValueError(
                f"FailureOptions: max_restarts={self.max_restarts} needs on_failure='continue' and a "
                "count >= 0 (a job that raises on a failure restarts with `stratagem run --max-restarts`)"
            )

    @property
    def continues(self) -> bool:
        """Whether the job goes on without a lost replica (``on_failure="continue"``)."""
        return self.on_failure == "continue"


@dataclass(frozen=True)
class Failure:
    """What the monitor found: the rank (None when unknown) and why, in words. ``silent``: the
    peer (or the store) fell silent, so no collective with it can finish."""

    rank: int | None
    why: str
    silent: bool = False


def _namespace_id(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def host_identity() -> str:
    """What tells this process's host apart from another's: the kernel's boot id and this
    process's pid and network namespaces, not the hostname alone (two machines, or two network
    namespaces of one, can share a hostname). Processes with equal identities can see each
    other's pids; others cannot, and are watched by their heartbeats only."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return "|".join([socket.gethostname(), boot, _namespace_id("pid"), _namespace_id("net")])


def _peer_record(raw: Any) -> tuple[str, int, str]:
    info = json.loads(raw)
    return str(info["host"]), int(info["pid"]), str(info.get("address", ""))


def _local_address(host: str, port: int) -> str:
    """The address this machine reaches ``host`` from ("" if it cannot tell)."""
    try:
        return route_source(host, port)
    except OSError:
        return ""


class FailureMonitor:
    """Heartbeat, failure records and the watchdog of one process (start once per process)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        *,
        store_host_rank: int | None = 0,
        prefix: str = "stratagem/failure/",
        options: FailureOptions | None = None,
        shutdown_wait: float = 60.0,
        close_connections: Callable[[], None] | None = None,
    ) -> None:
        self.rank = rank
        #: ends this process's collectives (the process groups torn down): called when this rank
        #: raised, once its record is written (and by the store host before it waits for its peers
        #: to read why), so that a peer blocked in a collective with it fails at once rather than
        #: when its watchdog's grace runs out
        self.close_connections = close_connections
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.store_host_rank = store_host_rank
        self.prefix = prefix
        self.options = options or FailureOptions()
        self.shutdown_wait = shutdown_wait
        self.failure: Failure | None = None
        self._failure_at = 0.0
        self._reported = False  # the main thread raised WorkerFailedError itself
        #: when the main thread began explaining a failed collective (None: it is not): the
        #: watchdog leaves it to raise, unless the explaining itself is stuck (a store call, or
        #: the store lock held by a watcher stuck in one, on a host that is cut off)
        self._probe_since: float | None = None
        self._closing = False
        self._ended = False
        self._store: Any = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers: dict[int, tuple[str, int, str]] = {}  # rank -> (host identity, pid, address)
        self._beats: dict[int, tuple[int, float]] = {}
        self._finished: set[int] = set()
        self._store_errors = 0
        #: the store host ended its program and this process said it need not wait for it any
        #: more: the store may be gone at any moment, so this process makes no more store calls
        #: (torch's client prints a C++ warning with a stack for each call on a closed store)
        self._released = False
        self._host = host_identity()
        #: this process's address as its peers reach it (for messages about it)
        self._address = _local_address(master_addr, master_port)
        #: when the watcher's store call now in flight began (None: none is): a call that does
        #: not return for ``dead_after_seconds`` means the store's host cannot be reached (a
        #: silent network cut leaves the call waiting; torch's client has no deadline for it)
        self._call_since: float | None = None
        self._stall_thread: threading.Thread | None = None
        #: a peer process on this host found stopped: ended (SIGKILL) when this process aborts,
        #: as nothing else can end it (it runs no code of its own until continued)
        self._stopped_peer: int | None = None
        #: the silent peer this process published a verdict on (the others may not see it alone)
        self._published_silent: int | None = None
        self._prev_hook = sys.excepthook
        #: the longest one store call of the watcher can block (then it raises)
        self._store_timeout = max(5.0, 2 * self.options.heartbeat_seconds)
        #: ranks that are no longer in the job (lost, and the survivors went on without them:
        #: ``on_failure="continue"``); their failure is not looked for again
        self.left: set[int] = set()
        #: failure records up to this index are about members that left (read no more: a rank
        #: that left may come back, and its old record must not count against it)
        self._records_from = 0

    # --- store helpers ------------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def _has(self, key: str) -> bool:
        return bool(self._store.check([key]))

    def _add(self, key: str, n: int) -> int:
        return int(self._store.add(key, n))

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> FailureMonitor:
        """Connect to the store, publish this process, start watching; install the hooks."""
        self._store = dist.TCPStore(
            self.master_addr, self.master_port, is_master=False,
            timeout=datetime.timedelta(seconds=self._store_timeout),
            wait_for_workers=False,
        )
        self._store.set(self._key("pid", self.rank), json.dumps(
            {"host": self._host, "pid": os.getpid(), "address": self._address}))
        self._add(self._key("hb", self.rank), 1)
        if self.store_host_rank is not None and self.store_host_rank != self.rank:
            self._peer_blocking(self.store_host_rank)
        self._learn_peers()
        sys.excepthook = self._excepthook
        explain_stops_with(self.known_failure)
        atexit.register(self.close)
        self._thread = threading.Thread(target=self._loop, name="stratagem-failure-monitor", daemon=True)
        self._thread.start()
        if self.store_host_rank != self.rank:
            self._stall_thread = threading.Thread(target=self._watch_stalls,
                                                  name="stratagem-failure-stall", daemon=True)
            self._stall_thread.start()
        return self

    def close(self) -> None:
        """The program ended: say so (unless the excepthook already did), let the store host wait
        for the others to end, then stop the watcher thread (always, see ``_halt``)."""
        if self._store is None:
            return
        if not self._ended:
            self._closing = True
            try:
                with self._lock:
                    if not self._released:
                        self._store.set(self._key("end", self.rank), "done")
            except Exception:  # noqa: BLE001 - the store may be gone at exit
                pass
            if self.rank == self.store_host_rank:
                # a peer still running is waited for until it ends, or says it has seen that this
                # process ended (it then stops using the store), or ``shutdown_wait`` runs out
                self._wait_for_peers(self._let_go, self.shutdown_wait)
            self._ended = True
        self._halt()

    def _halt(self) -> None:
        """Stop the watcher and wait until it has left the store's C++ client.

        A daemon thread that returns from a C++ call (which released the GIL) after the
        interpreter began to finalize is ended by ``pthread_exit``, whose unwinding through the
        binding's GIL guard calls ``std::terminate``: "terminate called without an active
        exception", exit code 134, after the program's work is done. The rank that hosts the
        store makes that likely: its store server is destroyed during finalization, which wakes
        its own watcher inside a store call. So the watcher is joined at exit on every path (the
        excepthook's too), for longer than its longest store call can take.
        """
        self._stop.set()
        explain_stops_with(None)
        stall = self._stall_thread
        if stall is not None and stall is not threading.current_thread():
            # it wakes every half heartbeat and makes no store call: gone at once, but joined, so
            # that nothing of the monitor is left running when the program's own exit goes on
            stall.join(timeout=self.options.heartbeat_seconds + 1.0)
        thread = self._thread
        if thread is None or thread is threading.current_thread() or not thread.is_alive():
            return
        thread.join(timeout=self._store_timeout + 2 * self.options.heartbeat_seconds + 1.0)
        if thread.is_alive():  # cannot happen while store calls honour their timeout; never abort
            sys.stderr.write(
                f"stratagem: rank {self.rank}: the failure monitor did not stop within "
                f"{self._store_timeout:.0f}s; ending the process without finalizing\n"
            )
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)

    def known_failure(self) -> tuple[int | None, str] | None:
        """What this process knows of a failed peer without a store call (any thread): the
        failure found, or a peer on this host whose process is gone (read now)."""
        found = self.failure
        if found is not None:
            return found.rank, found.why
        for p, (host, pid, _) in sorted(self._peers.items()):
            if p != self.rank and p not in self._finished and p not in self.left and host == self._host and not pid_alive(pid):
                return p, f"its process (pid {pid}) ended while the job ran (killed, crashed or raised)"
        return None

    def _let_go(self, p: int) -> bool:
        return p in self._finished or self._has(self._key("released", p))

    def _release(self) -> None:
        """The store host ended: say so to it (this process's last store call) and stop using the
        store, so the host need not wait for this process's end and this process never calls a
        store that is gone."""
        try:
            self._add(self._key("released", self.rank), 1)
        finally:
            self._released = True
            self._store_errors = 2

    def _wait_for_peers(self, satisfied: Any, limit: float) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                with self._lock:
                    self._scan_ends()
                    pending = [
                        p for p in range(self.world_size)
                        if p != self.rank and p not in self.left and not satisfied(p) and self._alive(p)
                    ]
            except Exception:  # noqa: BLE001
                return
            if not pending:
                return
            time.sleep(0.1)

    # --- watching -----------------------------------------------------------------------------
    def _loop(self) -> None:
        interval = self.options.heartbeat_seconds
        last = time.monotonic()
        while not self._stop.wait(interval):
            now = time.monotonic()
            if now - last > 2 * interval + 1.0:
                # this process was stopped (Ctrl-Z) or starved: its peers' silence was not
                # watched meanwhile, so their clocks start again (a peer resumed with it is fine)
                self._beats.clear()
            last = now
            if self._store_errors >= 2:  # the store is gone: nothing more to read or write
                pass
            elif self._store_host_gone():
                self._store_errors = 2
                if self.failure is None and not self._closing and not self._host_ended():
                    self._set_failure(Failure(self.store_host_rank, self._host_gone_why()))
            else:
                self._beat()
            self._abort_when_due()
            due = self._abort_due_in()
            if due is not None and due < interval and not self._stop.wait(max(due, 0.0) + 0.01):
                self._abort_when_due()  # due before the next beat: act then, not a beat later

    def _watch_stalls(self) -> None:
        """A second thread: notices the watcher stuck in a store call (the store's host cannot
        be reached), and ends this process the way the watcher would have."""
        interval = self.options.heartbeat_seconds / 2
        limit = self.options.dead_after_seconds
        last = time.monotonic()
        while not self._stop.wait(interval):
            now = time.monotonic()
            if now - last > 2 * interval + 1.0 and self._call_since is not None:
                self._call_since = now  # stopped or starved meanwhile: the call's wait starts now
            last = now
            since = self._call_since
            if self._closing and since is not None and time.monotonic() - since >= limit:
                # this rank is ending (its program raised) and cannot tell the store so: the store's
                # host is cut off. Its error is printed already; nothing is left to wait for
                sys.stderr.write(
                    f"stratagem: rank {self.rank}: the rendezvous store at {self.master_addr}:{self.master_port} "
                    f"did not answer for {limit:.0f}s while this rank reported its error; ending (exit code 1)\n"
                )
                sys.stderr.flush()
                os._exit(1)
            if self.failure is not None or self._closing or self._store_errors >= 2:
                if self.failure is not None and self.failure.silent:
                    self._abort_when_due()
                continue
            stopped = self._store_host_stopped()
            if stopped is not None:
                # the store's own process is stopped on this host: its server answers nothing,
                # so the watcher (stuck in a store call) cannot look; say so at once
                self._store_errors = 2
                self._stopped_peer = stopped
                self._set_failure(Failure(self.store_host_rank, f"its process (pid {stopped}) is "
                                          "stopped (SIGSTOP): no collective with it can finish; "
                                          "it is ended", silent=True))
                self._abort_when_due()
                continue
            if since is None:
                continue
            stalled = time.monotonic() - since
            if stalled >= limit and not self._host_ended():
                self._store_errors = 2  # no more store calls: each would wait as this one does
                who, where = self._store_side()
                self._set_failure(Failure(
                    who,
                    f"this host ({self._address or '?'}) got no answer from the rendezvous store {where} "
                    f"{self.master_addr}:{self.master_port} for {stalled:.0f}s (no reply and "
                    "no reset: the network between the two hosts is cut, or that host is gone)",
                    silent=True,
                ))
                self._abort_when_due()

    def _store_side(self) -> tuple[int | None, str]:
        """The rank to blame when the store cannot be reached, and how to say where the store
        is: the rank hosting it, or, when a launcher hosts it (``stratagem run``, torchrun), the
        first other rank at the store's address (on the host that is cut off)."""
        if self.store_host_rank is not None:
            return self.store_host_rank, "it hosts at"
        near = sorted(r for r, (_, _, address) in self._peers.items()
                      if address == self.master_addr and r != self.rank)
        if near:
            return near[0], f"on worker {near[0]}'s host, at"
        return None, "at"

    def _abort_when_due(self) -> None:
        due = self._abort_due_in()
        if due is not None and due <= 0:
            self._abort()

    def _abort_due_in(self) -> float | None:
        """Seconds until the watchdog stops this process (<= 0: now; None: it will not, as things
        stand)."""
        if self.failure is None or self._closing or self._reported:
            return None
        if self._continues_after(self.failure) and (
            not self.failure.silent or _waiting_in_collective_since() is None or waiting_can_give_up()
        ):
            # the main thread's collective fails (a reset; or, for a silent peer, its wait gives up
            # by itself), and the survivors go on without it. A silent peer while the main thread
            # waits where it cannot give up: stopped as without "continue"
            return None
        now = time.monotonic()
        probing = self._probe_since
        if probing is not None and now - probing < self._probe_bound():
            return self._probe_bound() - (now - probing)  # the main thread is about to raise itself
        # a silent peer was already waited for (dead_after_seconds): no collective with it can
        # finish, so there is nothing to give the main thread time for
        grace = 0.0 if self.failure.silent else self.options.grace_seconds
        if _waiting_in_collective_since() is not None:
            # blocked in a collective: it cannot finish with a failed peer, and no error may come
            # (the peer's connections open): a moment for a reset to arrive and be raised, then
            # the process is stopped
            grace = min(grace, RESET_WAIT_S)
        return grace - (now - self._failure_at)

    def _continues_after(self, failure: Failure) -> bool:
        """Whether the job goes on without the failed rank (``on_failure="continue"``): any rank
        but this one and the store's host (a silent one too: the collectives that can give up on it
        do, ``communicator.ProcessGroupCommunicator._wait``)."""
        return (
            self.options.continues
            and failure.rank is not None
            and failure.rank != self.store_host_rank
            and failure.rank != self.rank
        )

    def lost_peer(self) -> tuple[int, str] | None:
        """(rank, why) of a peer known lost that the job goes on without (``on_failure="continue"``;
        any thread, no store call): a collective waiting for it gives up."""
        found = self.failure
        if found is not None and found.rank is not None and self._continues_after(found):
            return found.rank, found.why
        return None

    def can_go_on_without(self, p: int | None) -> bool:
        """Whether the job can go on without rank ``p`` (known, not this process, not the store's
        host, the store still answering): ``on_failure="continue"``."""
        if p is None or p == self.rank or p == self.store_host_rank or self._store_errors >= 2:
            return False
        if self._store_host_gone():
            return False
        # the store's address still takes connections (a plain socket: a call of torch's client
        # on a store that is gone prints a C++ warning with a stack before it raises)
        try:
            with socket.create_connection((self.master_addr, self.master_port), timeout=1.0):
                return True
        except OSError:
            return False

    def gone(self, p: int) -> bool:
        """Whether rank ``p`` is out of the job: left already, its process gone on this host, a
        record of its failure, or no heartbeat for ``dead_after_seconds`` (main thread; store calls)."""
        if p in self.left:
            return True
        with self._lock:
            return p in self._failed_ranks() or not self._alive(p)  # _alive looks at a local pid first

    def _failed_ranks(self) -> set[int]:
        """Every rank a failure record names (its own, or another rank's verdict on it)."""
        out = set()
        for i in range(self._records_from + 1, self._add(self._key("nfail"), 0) + 1):
            key = self._key("fail", i)
            if self._has(key):
                out.add(int(json.loads(self._store.get(key))["rank"]))
        return out

    def continue_without(self, ranks: Iterable[int]) -> None:
        """The survivors went on without ``ranks``: stop watching them, forget the failure (and
        the records so far: they are about ranks that left)."""
        ranks = set(ranks)
        with self._lock:
            self.left.update(ranks)
            self.failure = None
            self._reported = False
            with contextlib.suppress(Exception):
                self._records_from = self._add(self._key("nfail"), 0)
            # a stopped process on this host that was left out is ended (as the watchdog ends it
            # without "continue"): continued later, it would only find the job gone on without it
            stopped = self._stopped_peer
            if stopped is not None and any(self._peers.get(p, ("", -1, ""))[1] == stopped for p in ranks):
                self._stopped_peer = None
                if pid_stopped(stopped):
                    with contextlib.suppress(OSError):
                        os.kill(stopped, signal.SIGKILL)

    def admit(self, ranks: Iterable[int]) -> None:
        """``ranks`` came back (new processes in their places): watch them again, from scratch."""
        with self._lock:
            for p in ranks:
                self.left.discard(p)
                self._peers.pop(p, None)
                self._beats.pop(p, None)
                self._finished.discard(p)

    def _probe_bound(self) -> float:
        """How long explaining a failed collective may take before it counts as stuck."""
        return min(self.options.dead_after_seconds, 10.0) + 2 * self.options.heartbeat_seconds

    def _store_host_stopped(self) -> int | None:
        """The pid of the store host when it is a local process stopped by a signal."""
        host = self.store_host_rank
        if host is None or host == self.rank or host not in self._peers:
            return None
        name, pid, _ = self._peers[host]
        return pid if name == self._host and pid_stopped(pid) else None

    def _store_host_gone(self) -> bool:
        """The store host is a local process that is gone (checked without touching the store)."""
        host = self.store_host_rank
        if host is None or host == self.rank or host not in self._peers:
            return False
        name, pid, _ = self._peers[host]
        return name == self._host and not pid_alive(pid)

    def _host_ended(self) -> bool:
        """The store host finished its program normally (its end record was seen): its store
        going away is not a failure."""
        return self.store_host_rank is not None and self.store_host_rank in self._finished

    def _host_gone_why(self) -> str:
        pid = self._peers[self.store_host_rank][1] if self.store_host_rank in self._peers else "?"
        return f"its process (pid {pid}) is gone: killed or crashed"

    def _beat(self) -> None:
        self._call_since = time.monotonic()  # waiting for the lock counts: a holder may be stuck
        try:
            with self._lock:
                self._add(self._key("hb", self.rank), 1)
                if not self._closing and self.failure is None:
                    self._detect()
                elif self.store_host_rank is not None and self.store_host_rank != self.rank:
                    self._scan_ends()
                self._store_errors = 0
                self._call_since = None
                if self._host_ended():
                    self._release()
        except Exception as e:  # noqa: BLE001 - a store that stopped answering
            self._call_since = None
            self._store_errors += 1
            if _RESET.search(str(e)):
                # its process is gone (a reset, not a silence): the next call would try to connect
                # again until its timeout (6 s more, where a launcher that hosted it had ended)
                self._store_errors = max(self._store_errors, 2)
            if self._store_errors >= 2 and self.failure is None and not self._closing and not self._host_ended():
                gone = self._store_host_gone()  # a local store host's pid says more than its store
                self._set_failure(Failure(self.store_host_rank, self._host_gone_why()) if gone else self._store_gone(e))

    def _store_gone(self, exc: BaseException) -> Failure:
        where = f"{self.master_addr}:{self.master_port}"
        if self.store_host_rank is None:
            return Failure(None, f"the rendezvous store at {where} (torchrun's agent) stopped answering")
        return Failure(
            self.store_host_rank,
            f"it hosted the rendezvous store at {where}, which stopped answering",
        )

    def _set_failure(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure
            self._failure_at = time.monotonic()
            if self._store_errors >= 2:
                return
            try:
                with self._lock:
                    self._add(self._key("seen", failure.rank), 1)
            except Exception:  # noqa: BLE001
                pass

    def _scan_ends(self) -> None:
        for p in range(self.world_size):
            if p != self.rank and p not in self._finished and self._has(self._key("end", p)):
                self._finished.add(p)

    def _peer(self, p: int) -> tuple[str, int, str] | None:
        if p not in self._peers:
            key = self._key("pid", p)
            if not self._has(key):
                return None
            self._peers[p] = _peer_record(self._store.get(key))
        return self._peers[p]

    def _learn_peers(self) -> None:
        """Read every peer's record once at start (each publishes its own right after the process
        group formed, so this waits moments): which peer runs where must be known before a fault,
        since a host cut off from the store can read nothing afterwards. Without it, a cut early
        in training (before the first heartbeat read the records) left a rank unable to name the
        peer on the store's host ("a peer worker failed"). A peer that does not publish within the
        store timeout (it died meanwhile) is looked up by the heartbeat later, as before."""
        others = [self._key("pid", p) for p in range(self.world_size) if p != self.rank]
        if not others:
            return
        try:
            self._store.wait(others, datetime.timedelta(seconds=self._store_timeout))
            for p in range(self.world_size):
                if p != self.rank and p not in self._peers:
                    self._peer_blocking(p)  # published (the wait returned): one read
        except Exception:  # noqa: BLE001 - a peer gone, or the store unreachable: the heartbeat decides
            pass

    def _peer_blocking(self, p: int) -> None:
        self._peers[p] = _peer_record(self._store.get(self._key("pid", p)))  # waits (store timeout)

    def _alive(self, p: int) -> bool:
        peer = self._peer(p)
        if peer is not None and peer[0] == self._host and not pid_alive(peer[1]):
            return False
        beat = self._add(self._key("hb", p), 0)
        last = self._beats.get(p)
        now = time.monotonic()
        if last is None or last[0] != beat:
            self._beats[p] = (beat, now)
            return True
        return now - last[1] < self.options.dead_after_seconds

    def _recorded_failure(self) -> Failure | None:
        count = self._add(self._key("nfail"), 0)
        for i in range(self._records_from + 1, count + 1):
            key = self._key("fail", i)
            if not self._has(key):
                continue
            rec = json.loads(self._store.get(key))
            if rec["rank"] == self.rank or rec["rank"] in self.left:
                continue
            if "why" in rec:  # another rank's verdict on a peer that fell silent, died or stopped
                return Failure(int(rec["rank"]), f"{rec['why']} (seen by worker {rec['by']})", silent=bool(rec["silent"]))
            return Failure(int(rec["rank"]), f"it raised {rec['summary']} (its traceback is in its output)")
        return None

    def _publish(self, found: Failure) -> None:
        """Tell every rank what this one found (holding the lock): each reads it at its next
        beat, rather than waiting out the same silence on its own clock, which restarts when its
        watcher was starved on a loaded machine."""
        rec = json.dumps({"rank": found.rank, "why": found.why, "silent": found.silent, "by": self.rank})
        n = self._add(self._key("nfail"), 1)
        self._store.set(self._key("fail", n), rec)
        if found.silent:
            self._published_silent = found.rank

    def _detect(self) -> Failure | None:
        """One look at the store and the peers (holding the lock); records what it finds."""
        found = self._recorded_failure()
        if found is None:
            self._scan_ends()
            for p in range(self.world_size):
                if p == self.rank or p in self._finished or p in self.left:
                    continue
                peer = self._peer(p)
                if peer is not None and peer[0] == self._host and not pid_alive(peer[1]):
                    found = Failure(p, f"its process (pid {peer[1]}) is gone: killed or crashed")
                    break
                if peer is not None and peer[0] == self._host and pid_stopped(peer[1]):
                    found = Failure(p, f"its process (pid {peer[1]}) is stopped (SIGSTOP): no "
                                       "collective with it can finish; it is ended", silent=True)
                    self._stopped_peer = peer[1]
                    break
                if not self._alive(p):
                    if peer is not None and peer[0] == self._host and not pid_alive(peer[1]):
                        # it died between the look above and _alive's own: gone, not silent
                        found = Failure(p, f"its process (pid {peer[1]}) is gone: killed or crashed")
                    else:
                        found = Failure(p, self._silence_why(peer), silent=True)
                    break
            if found is not None and found.rank is not None:
                with contextlib.suppress(Exception):  # the store may be going: the verdict stands here
                    self._publish(found)
        if found is not None:
            self._set_failure(found)
        return found

    def _silence_why(self, peer: tuple[str, int, str] | None) -> str:
        quiet = f"it sent no heartbeat for {self.options.dead_after_seconds:.0f}s"
        if peer is not None and peer[0] == self._host:
            return f"{quiet} (its process, pid {peer[1]}, is alive but not running: stopped or hung)"
        where = f" from its host {peer[2]}" if peer is not None and peer[2] else ""
        return (f"it sent no heartbeat{where} for {self.options.dead_after_seconds:.0f}s (that host "
                "cannot be reached from the store's, or the process is stopped)")

    # --- explaining a failed collective ---------------------------------------------------------
    def probe(self, exc: BaseException) -> tuple[int | None, str]:
        """Which rank failed, for ``classify_failure`` (called on the main thread)."""
        self._probe_since = time.monotonic()
        try:
            return self._probe(exc)
        finally:
            self._reported = True
            self._probe_since = None

    def _probe(self, exc: BaseException) -> tuple[int | None, str]:
        timed_out = "timeout" in str(exc).lower() or "timed out" in str(exc).lower()
        peer_lost = not timed_out and looks_like_peer_loss(str(exc))
        wait = self.options.heartbeat_seconds if timed_out else min(self.options.dead_after_seconds, 10.0)
        deadline = time.monotonic() + wait
        fallback_at = time.monotonic() + 3.0
        if self.failure is None and self._store_host_gone():
            self._store_errors = 2
            self._set_failure(Failure(self.store_host_rank, self._host_gone_why()))
        while self.failure is None and not self._ended and self._store_errors < 2:
            # never blocked for long on the lock: the watcher may hold it, stuck in a store call
            # that a cut-off host never answers (its stall watcher then sets the failure)
            if self._lock.acquire(timeout=0.2):
                try:
                    self._detect()
                except Exception as e:  # noqa: BLE001
                    self._set_failure(self._store_gone(e))
                finally:
                    self._lock.release()
            if self.failure is not None:
                break
            now = time.monotonic()
            if self.world_size == 2 and peer_lost and now >= fallback_at:
                self._set_failure(Failure(1 - self.rank, "its connection closed"))
                break
            if now >= deadline:
                break
            time.sleep(0.2)
        if self.failure is None:
            ended = sorted(self._finished)
            if ended and not timed_out:
                return ended[0], "its program had already ended (this collective was never joined)"
            return None, ""
        return self.failure.rank, self.failure.why

    # --- ending ---------------------------------------------------------------------------------
    def _message(self) -> str:
        f = self.failure
        who = f"worker {f.rank}" if f is not None and f.rank is not None else "a peer worker"
        why = f": {f.why}" if f is not None and f.why else ""
        return f"{who} failed{why}"

    def _mark(self, state: str) -> None:
        if self._store_errors >= 2:
            return  # the store is gone or cannot be reached: the call would wait or fail
        self._call_since = time.monotonic()  # watched, as the report's own call is
        try:
            with self._lock:
                if not self._released:
                    self._store.set(self._key("end", self.rank), state)
        except Exception:  # noqa: BLE001
            pass
        finally:
            self._call_since = None

    def _abort(self) -> None:
        """The main thread is stuck (in a collective that cannot be interrupted): end the process."""
        err = WorkerFailedError(
            f"{self._message()}; rank {self.rank} was blocked and is stopped "
            f"(exit code {ABORT_EXIT_CODE})",
            rank=self.failure.rank if self.failure else None,
        )
        mark_reported()
        sys.stderr.write(f"stratagem: rank {self.rank}: WorkerFailedError: {err}\n")
        sys.stderr.flush()
        record_followed(f"WorkerFailedError: {err}", err.rank)
        self._let_the_verdict_spread()
        self._mark("aborted")
        for child in multiprocessing.active_children():
            child.terminate()
        if self._stopped_peer is not None and pid_stopped(self._stopped_peer):
            with contextlib.suppress(OSError):
                os.kill(self._stopped_peer, signal.SIGKILL)
        os._exit(ABORT_EXIT_CODE)

    def _let_the_verdict_spread(self) -> None:
        """Before this process ends on a silent peer it found (a host cut off or gone): wait, at
        most two heartbeats, until the other live ranks have read that verdict. Its end may take
        the store with it (torchrun's agent, on this host, ends once its replica has), and a rank
        that had not read the verdict then learned only that the store went away: it named the
        store instead of the peer (seen across hosts, the store on the finder's host)."""
        failed = self._published_silent
        if failed is None or self._store_errors >= 2:
            return
        want = self.world_size - 1  # every rank but the silent one (this one counted itself)
        deadline = time.monotonic() + 2 * self.options.heartbeat_seconds
        while time.monotonic() < deadline:
            # never blocked on the lock: a store call stuck in another thread may hold it
            if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return
            try:
                if self._add(self._key("seen", failed), 0) >= want:
                    return
            except Exception:  # noqa: BLE001 - the store is going: nothing more to wait for
                return
            finally:
                self._lock.release()
            time.sleep(0.05)

    def record_exception(self, exc: BaseException, tb_text: str) -> None:
        """Publish that this rank failed with ``exc`` (its traceback), once."""
        summary = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        rec = json.dumps({"rank": self.rank, "summary": summary, "traceback": tb_text[-20000:]})
        self._call_since = time.monotonic()  # watched: a store cut off must not hold the exit
        try:
            with self._lock:
                if self._released:  # the store host has ended: nobody is left to read the record
                    return
                n = self._add(self._key("nfail"), 1)
                self._store.set(self._key("fail", n), rec)
        finally:
            self._call_since = None

    def _excepthook(
        self, etype: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        self._closing = True
        mark_reported()  # what follows says why this rank ends: a stop signal adds nothing
        # an error that only reports another process's failure (that process says why):
        # one line here, and the launcher told whom this process followed
        follows = getattr(value, "follows_rank", None)
        consequence = isinstance(value, WorkerFailedError) or follows is not None or (
            isinstance(value, CollectiveError) and self.failure is not None
        )
        try:
            if consequence:
                sys.stderr.write(f"stratagem: rank {self.rank}: {etype.__name__}: {value}\n")
                sys.stderr.flush()
                record_followed(f"{etype.__name__}: {value}",
                                follows if follows is not None else getattr(value, "rank", None))
                self._mark("aborted")
                if self._store_errors >= 2 and self._call_since is not None:
                    # the watcher is stuck in a store call that a cut-off host never answers:
                    # joining it at exit (``_halt``) would hold this failed process for seconds
                    sys.stdout.flush()
                    os._exit(ABORT_EXIT_CODE)
            else:
                text = "".join(traceback.format_exception(etype, value, tb))
                if self._prev_hook is sys.__excepthook__:
                    # in one write, as Python's hook prints it: the ranks of a job share one stderr
                    # (a launcher's), where a peer's one-line report written meanwhile would
                    # otherwise land inside this traceback, mid-line
                    sys.stderr.write(text)
                    sys.stderr.flush()
                else:
                    self._prev_hook(etype, value, tb)
                self.record_exception(value, text)
                self._mark("failed")
                # a peer blocked in a collective with this rank fails now (its connection closed)
                # and raises WorkerFailedError naming this rank, rather than waiting for its
                # watchdog's grace while this process finalizes (seconds on a busy machine)
                if self.close_connections is not None:
                    self.close_connections()
                if self.rank == self.store_host_rank:
                    # our store carries the record: keep it up until the peers have read it
                    limit = self.options.grace_seconds + 3 * self.options.heartbeat_seconds
                    self._wait_for_peers(self._saw_failure, limit)
        except Exception:  # noqa: BLE001 - reporting must never hide the original error
            if not consequence:
                return
        finally:
            self._ended = True
            self._stop.set()

    def _saw_failure(self, p: int) -> bool:
        return p in self._finished or self._add(self._key("seen", self.rank), 0) >= sum(
            1 for q in range(self.world_size) if q != self.rank
        )


# --- explaining a failed collective ----------------------------------------------------------------
#: Explains a failed collective: returns (failed rank or None, human explanation or "").
FailureProbe = Callable[[BaseException], tuple[int | None, str]]


def launcher_probe(exc: BaseException) -> tuple[int | None, str]:
    """Which replica failed, as far as the self-launcher of this process knows (a child's exit)."""
    kids = children()
    if kids is not None:
        deadline = time.monotonic() + 2.0
        while kids.failed is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if kids.failed is not None:
            rank, code = kids.failed
            return rank, f"it exited with code {code}"
    return None, ""


def job_probe(monitor: FailureMonitor | None) -> FailureProbe:
    """The probe of a job: the failure monitor's records first, then the launcher's children."""

    def probe(exc: BaseException) -> tuple[int | None, str]:
        rank, why = monitor.probe(exc) if monitor is not None else (None, "")
        return (rank, why) if rank is not None else launcher_probe(exc)

    return probe


#: a C++ source location torch's backends put before their messages: ``[/path/pair.cc:553] ``
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|cu|h|hpp):\d+\]\s*")


def backend_text(text: str) -> str:
    """The first line of a backend's error without its source location and advice boilerplate
    (gloo: "This is typically caused by ... GLHF!"): what happened, in a few words."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    first = _SOURCE_PREFIX.sub("", first)
    cut = first.find(" This is typically caused")
    if cut > 0:
        first = first[:cut]
    return first.rstrip(" .")


@contextlib.contextmanager
def collectives_explained(comm: Any, op: str) -> Iterator[None]:
    """Collectives made by code that does not go through a Communicator (FSDP2's, DTensor's):
    a backend error saying a peer went away becomes the ``WorkerFailedError`` naming it (one
    line on this rank, as for the job's own collectives); any other error passes unchanged."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, CollectiveError) or not looks_like_peer_loss(str(e)):
            raise
        raise classify_failure(e, getattr(comm, "probe", None), op) from e


def classify_failure(exc: BaseException, probe: FailureProbe | None, op: str) -> CollectiveError:
    """Turn a torch.distributed error into a CollectiveError that says what happened."""
    rank, why = (None, "")
    if probe is not None:
        try:
            rank, why = probe(exc)
        except Exception:  # noqa: BLE001 - explaining must never hide the original error
            rank, why = (None, "")
    text = backend_text(str(exc)) or type(exc).__name__
    lowered = str(exc).lower()
    who = f"worker {rank}" if rank is not None else "a peer worker"
    if rank is None and ("timed out" in lowered or "timeout" in lowered):
        return CollectiveTimeoutError(
            f"{op} timed out waiting for the other workers ({text}); a worker is stuck or the "
            "timeout is too short for this step (raise `timeout=`)"
        )
    if rank is None and not looks_like_peer_loss(lowered):
        # nothing says a peer failed: this rank's own call went wrong (e.g. a tensor on a
        # device the backend does not serve); say so rather than blame another worker
        return CollectiveError(f"{op} failed on this worker: {type(exc).__name__}: {text}")
    detail = f": {why}" if why else ""
    return WorkerFailedError(f"{op} failed because {who} failed{detail} ({text})", rank=rank)
