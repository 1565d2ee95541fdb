"""Failure detection: a process's monitor, built of its heartbeat, the job's verdict and the watchdog.

Every process of a job runs one ``FailureMonitor`` thread with its own connection to the
rendezvous store. Each beat it makes two store calls whatever the job's size: its own beat (one
key carrying its state: running, or how it ended), and one read of the job's verdict. One process,
the watcher (the store's host, else the lowest rank; ``verdict.py``), reads every beat in one
``multi_get`` and publishes that verdict: its own pass count (every rank takes the watcher for
silent when it stops changing), the number of failure records, the ranks that ended. A rank that
raised writes a record with its traceback; a rank that finds a peer on its own host gone or
stopped (its pid), or the watcher silent, writes a verdict record; the watcher writes one for a
rank whose beat stopped for ``dead_after_seconds``; a store that stops answering names its host.
``probe`` explains a failed collective with what the monitor knows, so ``WorkerFailedError``
names the rank. A gloo collective cannot be interrupted from another thread: when a failure is
known and the main thread has not raised within ``grace_seconds``, the watchdog prints the error
and ends the process with exit code 1 (``watchdog.py``).

Tracebacks are printed once: the rank that raised prints its own; the others print one line.
Costs (docs/SCALE.md): 2N + 8 store calls a second for the job (1 s beats); start-up about 6 calls a rank.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch.distributed as dist

from stratagem.cluster.stopping import explain_stops_with, mark_reported, record_followed
from stratagem.comm.errors import (
    CollectiveError,
    CollectiveMismatchError,
    WorkerFailedError,
    looks_like_peer_loss,
)
from stratagem.comm.heartbeat import (
    ABORTED,
    DONE,
    ENDED,
    ENDED_NORMALLY,
    FAILED,
    RELEASED,
    Heartbeat,
    Keys,
    Peer,
    host_identity,
    local_peers,
    peer_record,
    publish_self,
    read_all,
    read_directory,
    write_directory,
)
from stratagem.comm.interfaces import route_source
from stratagem.comm.sequence import CollectiveLog, Position, disagreement, explain, odd_one
from stratagem.comm.verdict import (
    ENDED_WHY,
    FailureProbe,
    Verdict,
    VerdictReader,
    Watcher,
    backend_text,
    classify_failure,
    collectives_explained,
    deputy_of,
    launcher_probe,
    publish_record,
    read_records,
    watcher_of,
)
from stratagem.comm.watchdog import (
    ABORT_EXIT_CODE,
    RESET_WAIT_S,
    abort_due_in,
    giving_up_allowed,
    in_collective,
    waiting_can_give_up,
)
from stratagem.core.procs import pid_alive, pid_stopped

__all__ = [
    "ABORT_EXIT_CODE",
    "RESET_WAIT_S",
    "Failure",
    "FailureMonitor",
    "FailureOptions",
    "FailureProbe",
    "backend_text",
    "classify_failure",
    "collectives_explained",
    "giving_up_allowed",
    "host_identity",
    "in_collective",
    "job_probe",
    "launcher_probe",
    "waiting_can_give_up",
]

#: a store call's error that says the store's process is gone (not merely silent)
_RESET = re.compile(r"reset by peer|broken pipe|connection refused|\beof\b|connection was likely closed", re.I)


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
    #: "failed" (a peer died, raised, fell silent) or "mismatch" (the replicas wait in different
    #: collectives: a mistake in the program, which no replica can go on from)
    kind: str = "failed"


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
        self._keys = Keys(prefix)
        self._heartbeat: Heartbeat | None = None
        self._reader: VerdictReader | None = None
        #: this process's watcher of the job (only on the rank that watches)
        self._watcher: Watcher | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: rank -> (host identity, pid, address): the ranks of this host, the store's host and the
        #: watcher (every rank, on the watcher)
        self._peers: dict[int, Peer] = {}
        #: the ranks at the store's address (from the watcher's directory)
        self._near: list[int] = []
        #: the directory is not written yet (on the watcher: a rank's record is missing) or not
        #: read yet (elsewhere): looked for again each beat until it is
        self._directory_pending = False
        self._finished: set[int] = set()
        #: those of them whose program ended normally (returned; not raised or aborted)
        self._ended_normally: set[int] = set()
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
        #: ranks some failure record names (the watcher does not publish a verdict on them again)
        self._recorded: set[int] = set()
        #: the job's numbered collectives (``watch_collectives``), and whether a disagreement
        #: between them was recorded already
        self._log: CollectiveLog | None = None
        self._mismatch_recorded = False

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> FailureMonitor:
        """Connect to the store, publish this process, start watching; install the hooks."""
        self._store = dist.TCPStore(
            self.master_addr, self.master_port, is_master=False,
            timeout=datetime.timedelta(seconds=self._store_timeout),
            wait_for_workers=False,
        )
        me = (self._host, os.getpid(), self._address)
        self._heartbeat = Heartbeat(self._store, self._keys, self.rank)
        self._heartbeat.where = self._where
        self._reader = VerdictReader(self._store, self._keys, self.options.dead_after_seconds)
        publish_self(self._store, self._keys, self.rank, me, self._heartbeat)
        self._peers[self.rank] = me
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

    def watch_collectives(self, log: CollectiveLog) -> None:
        """Say, in each beat, which of ``log``'s collectives this process waits in; the watcher
        compares them (``comm.sequence``)."""
        self._log = log

    def _where(self) -> str | None:
        pos = self._log.position() if self._log is not None else None
        return pos.encode() if pos is not None else None

    def close(self) -> None:
        """The program ended: say so (unless the excepthook already did), let the store host wait
        for the others to end, then stop the watcher thread (always, see ``_halt``)."""
        if self._store is None:
            return
        if not self._ended:
            self._closing = True
            with contextlib.suppress(Exception):  # the store may be gone at exit
                with self._lock:
                    if not self._released:
                        self._say(DONE)
            if self.rank == self.store_host_rank:
                # a peer still running is waited for until it ends, or says it has seen that this
                # process ended (it then stops using the store), or ``shutdown_wait`` runs out
                self._wait_for_peers(lambda: self._finished.__contains__, self.shutdown_wait)
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

    def _release(self) -> None:
        """The store host ended: say so to it (this process's last store call) and stop using the
        store, so the host need not wait for this process's end and this process never calls a
        store that is gone."""
        try:
            self._say(RELEASED)
        finally:
            self._released = True
            self._store_errors = 2

    def _wait_for_peers(self, looks: Callable[[], Callable[[int], bool]], limit: float) -> None:
        """Wait until every live peer is ``looks()`` satisfied (a look: one call or two)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                with self._lock:
                    self._scan_ends()
                    satisfied = looks()
                    pending = [
                        p for p in self._members()
                        if p != self.rank and not satisfied(p) and self._alive(p)
                    ]
            except Exception:  # noqa: BLE001
                return
            if not pending:
                return
            time.sleep(0.1)

    # --- the store's keys -------------------------------------------------------------------------
    def _members(self) -> list[int]:
        return [p for p in range(self.world_size) if p not in self.left]

    def _watcher_rank(self) -> int:
        return watcher_of(self._members(), self.store_host_rank)

    def _say(self, state: str) -> None:
        """This process's state, in its beat (and, on the watcher, in the verdict at once)."""
        assert self._heartbeat is not None
        self._heartbeat.beat(state)
        if self._watcher is not None:
            self._publish_verdict()

    def _publish_verdict(self) -> Verdict:
        assert self._watcher is not None and self._heartbeat is not None
        verdict = self._watcher.publish()
        if self._heartbeat.state in ENDED:  # the watcher's own end, with the others'
            done = {*verdict.done, self.rank} if self._heartbeat.state in ENDED_NORMALLY else set(verdict.done)
            verdict = Verdict(verdict.seq, verdict.by, verdict.nfail, tuple(sorted({*verdict.ended, self.rank})),
                              tuple(sorted(done)))
            self._store.set(self._keys.verdict, verdict.encode())
        return verdict

    def _learn_peers(self) -> None:
        """At start: the watcher reads every record (one wait, one ``multi_get``) and writes the
        directory; every other rank waits for the directory and reads its own host's list (which
        peers it can watch by their pids) and the watcher's record. Which peer runs where must be
        known before a fault, since a host cut off from the store can read nothing afterwards."""
        watcher = self._watcher_rank()
        if watcher == self.rank:
            self._become_watcher()
            return
        directory = read_directory(self._store, self._keys, self._store_timeout)
        self._directory_pending = directory is None
        if directory is not None:
            self._near = [int(r) for r in directory.get("near", ())]
        with contextlib.suppress(Exception):  # a peer gone, or the store unreachable: the beats decide
            self._learn_local()
            if watcher not in self._peers:
                self._peer_blocking(watcher)

    def _look_for_directory(self) -> None:
        """A rank that started before the directory was written: it reads it once it is (and its
        host's list again, now whole); the watcher writes it once every record is in."""
        if self._watcher is not None:
            if all(p in self._peers for p in self._members()):
                write_directory(self._store, self._keys, self._peers, self.master_addr)
                self._directory_pending = False
            return
        if not self._store.check([self._keys.directory]):
            return
        directory = read_directory(self._store, self._keys, self._store_timeout)
        if directory is not None:
            self._near = [int(r) for r in directory.get("near", ())]
            self._learn_local()
            self._directory_pending = False

    def _become_watcher(self) -> None:
        others = [p for p in self._members() if p != self.rank]
        self._watcher = Watcher(self._store, self._keys, self.rank, self.options.dead_after_seconds)
        self._peers.update(read_all(self._store, self._keys, others, self._store_timeout))
        self._directory_pending = True
        self._look_for_directory()
        self._publish_verdict()

    def _learn_local(self) -> None:
        """The ranks on this host and their pids (one read of this host's list)."""
        raw = self._store.get(self._keys.host(self._host))
        for r, pid in local_peers(raw).items():
            if r != self.rank:
                self._peers[r] = (self._host, pid, self._address)

    def _peer_blocking(self, p: int) -> None:
        self._peers[p] = peer_record(self._store.get(self._keys.pid(p)))  # waits (store timeout)

    def _scan_ends(self) -> Verdict | None:
        """One look at the job's state: on the watcher, every beat (one call) and a verdict
        published; elsewhere, the verdict read (one call). Returns the verdict."""
        now = time.monotonic()
        verdict: Verdict | None
        if self._watcher is not None:
            self._watch_pass(now)
            verdict = self._publish_verdict()
        else:
            assert self._reader is not None
            verdict = self._reader.read(now)
        if verdict is not None:
            self._finished.update(r for r in verdict.ended if r != self.rank)
            self._ended_normally.update(r for r in verdict.done if r != self.rank)
        return verdict

    def _watch_pass(self, now: float) -> None:
        """The watcher's look at every beat; a verdict record on each rank newly silent."""
        w = self._watcher
        assert w is not None
        members = [p for p in self._members() if p != self.rank]
        for p in members:
            if p not in self._peers and self._store.check([self._keys.pid(p)]):  # late at start-up
                self._peers[p] = peer_record(self._store.get(self._keys.pid(p)))
        w.read([p for p in members if p in self._peers], now)
        self._finished.update(w.book.ended())
        self._ended_normally.update(w.book.ended_normally())
        if self._closing or self.failure is not None:
            return
        self._compare_positions(w, members)
        for p in w.newly_silent(now, self._finished | self.left | self._recorded):
            self._publish(Failure(p, self._silence_why(self._peers.get(p)), silent=True))

    def _compare_positions(self, w: Watcher, members: list[int]) -> None:
        """The watcher: every rank's collective position from the beats just read (and its own);
        one record when two ranks wait in different collectives at the same number."""
        if self._mismatch_recorded:
            return
        positions = {p: pos for p in members if p not in self.left
                     if (pos := Position.decode(w.book.wheres.get(p, ""))) is not None}  # fmt: skip
        own = self._log.position() if self._log is not None else None
        if own is not None:
            positions[self.rank] = own
        found = disagreement(positions)
        if found is None:
            return
        seq, by_what = found
        self._mismatch_recorded = True
        odd = odd_one(by_what)
        publish_record(self._store, self._keys, {"rank": odd, "why": explain(seq, by_what),
                                                 "silent": True, "by": self.rank, "mismatch": True})
        self._published_silent = odd  # its end waits until the others read it (it may take the store)

    # --- watching -----------------------------------------------------------------------------
    def _loop(self) -> None:
        # the watcher looks twice a beat, so that a silence is seen within half a beat of
        # ``dead_after_seconds`` (one hop more than each rank's own look used to take)
        interval = self.options.heartbeat_seconds / (2 if self._watcher is not None else 1)
        last = time.monotonic()
        while not self._stop.wait(interval):
            now = time.monotonic()
            if now - last > 2 * interval + 1.0:
                # this process was stopped (Ctrl-Z) or starved: its peers' silence was not
                # watched meanwhile, so their clocks start again (a peer resumed with it is fine)
                self._forget_clocks()
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

    def _forget_clocks(self) -> None:
        if self._watcher is not None:
            self._watcher.forget()
        if self._reader is not None:
            self._reader.forget()
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
        near = sorted(r for r in self._near if r != self.rank and r not in self.left)
        if not near:
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
        now = time.monotonic()
        probing = self._probe_since
        return abort_due_in(
            silent=self.failure.silent,
            continues=self._continues_after(self.failure),
            failure_age=now - self._failure_at,
            grace=self.options.grace_seconds,
            probing_for=None if probing is None else now - probing,
            probe_bound=self._probe_bound(),
        )

    def _continues_after(self, failure: Failure) -> bool:
        """Whether the job goes on without the failed rank (``on_failure="continue"``): any rank
        but this one and the store's host (a silent one too: the collectives that can give up on it
        do, ``communicator.ProcessGroupCommunicator._wait``)."""
        return (
            self.options.continues
            and failure.kind != "mismatch"
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
        count = int(self._store.add(self._keys.nfail, 0))
        return {int(rec["rank"]) for rec in read_records(self._store, self._keys, self._records_from, count)}

    def continue_without(self, ranks: Iterable[int]) -> None:
        """The survivors went on without ``ranks``: stop watching them, forget the failure (and
        the records so far: they are about ranks that left). The lowest survivor watches when the
        watcher was among them."""
        ranks = set(ranks)
        with self._lock:
            self.left.update(ranks)
            self.failure = None
            self._reported = False
            with contextlib.suppress(Exception):
                self._records_from = int(self._store.add(self._keys.nfail, 0))
                self._recorded.clear()
            if self._watcher is not None:
                self._watcher.forget(ranks)
            elif self._watcher_rank() == self.rank:
                with contextlib.suppress(Exception):
                    self._become_watcher()
            elif self._reader is not None:
                self._reader.forget()
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
        ranks = set(ranks)
        with self._lock:
            for p in ranks:
                self.left.discard(p)
                self._peers.pop(p, None)
                self._finished.discard(p)
                self._ended_normally.discard(p)
            if self._watcher is not None:
                self._watcher.forget(ranks)  # its pass reads their records again
            else:
                with contextlib.suppress(Exception):
                    self._learn_local()

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
                assert self._heartbeat is not None
                self._heartbeat.beat()
                if self._directory_pending:
                    self._look_for_directory()
                verdict = self._scan_ends()
                if not self._closing and self.failure is None:
                    self._detect(verdict)
                self._store_errors = 0
                self._call_since = None
                if self._host_ended() and self.rank != self.store_host_rank:
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
                    self._store.add(self._keys.seen(failure.rank), 1)
            except Exception:  # noqa: BLE001
                pass

    def _alive(self, p: int) -> bool:
        """Whether ``p`` looks alive: its pid on this host, the watcher's book (on the watcher),
        the verdict changing (``p`` the watcher). The watcher's verdict records name the others."""
        peer = self._peers.get(p)
        if peer is not None and peer[0] == self._host and not pid_alive(peer[1]):
            return False
        if self._watcher is not None:
            return self._watcher.book.age(p, time.monotonic()) < self.options.dead_after_seconds
        if p == self._watcher_rank() and self._reader is not None:
            return not self._reader.watcher_silent(time.monotonic())
        return True

    def _recorded_failure(self, count: int) -> Failure | None:
        found = None
        for rec in read_records(self._store, self._keys, self._records_from, count):
            r = int(rec["rank"])
            self._recorded.add(r)
            if found is None and rec.get("mismatch"):  # every rank's error, the named one's too
                found = Failure(r, str(rec["why"]), silent=True, kind="mismatch")
                continue
            if found is not None or r == self.rank or r in self.left:
                continue
            if "why" in rec:  # another rank's verdict on a peer that fell silent, died or stopped
                found = Failure(r, f"{rec['why']} (seen by worker {rec['by']})", silent=bool(rec["silent"]))
            else:
                found = Failure(r, f"it raised {rec['summary']} (its traceback is in its output)")
        return found

    def _publish(self, found: Failure) -> None:
        """Tell every rank what this one found (holding the lock): each reads it at its next
        beat, through the verdict's count of records, rather than waiting out the same silence
        on its own clock, which restarts when its watcher was starved on a loaded machine."""
        publish_record(self._store, self._keys,
                       {"rank": found.rank, "why": found.why, "silent": found.silent, "by": self.rank})
        if found.rank is not None:
            self._recorded.add(found.rank)
        if found.silent:
            self._published_silent = found.rank

    def _detect(self, verdict: Verdict | None, direct: bool = False) -> Failure | None:
        """One look at the verdict and this host's peers (holding the lock); records what it
        finds. ``direct``: the count of records is read from the store too (explaining a failed
        collective: a record written since the watcher's last pass counts)."""
        count = verdict.nfail if verdict is not None else 0
        if direct:
            count = max(count, int(self._store.add(self._keys.nfail, 0)))
        found = self._recorded_failure(count)
        if found is None:
            found = self._local_failure()
            deputy = True
            if found is None and self._watcher is None and self._watcher_silent():
                w = self._watcher_rank()
                found = Failure(w, self._silence_why(self._peers.get(w)), silent=True)
                deputy = deputy_of(self._members(), w) == self.rank  # one record, not one a rank
            if found is not None and found.rank is not None and deputy:
                with contextlib.suppress(Exception):  # the store may be going: the verdict stands here
                    self._publish(found)
        if found is not None:
            self._set_failure(found)
        return found

    def _watcher_silent(self) -> bool:
        w = self._watcher_rank()
        return (self._reader is not None and w != self.rank and w not in self._finished
                and self._reader.watcher_silent(time.monotonic()))

    def _local_failure(self) -> Failure | None:
        """A peer on this host whose process is gone or stopped (its pid; no store call)."""
        for p, (host, pid, _) in sorted(self._peers.items()):
            if p == self.rank or p in self._finished or p in self.left or host != self._host:
                continue
            if not pid_alive(pid):
                return Failure(p, f"its process (pid {pid}) is gone: killed or crashed")
            if pid_stopped(pid):
                self._stopped_peer = pid
                return Failure(p, f"its process (pid {pid}) is stopped (SIGSTOP): no "
                                  "collective with it can finish; it is ended", silent=True)
        return None

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
                    self._detect(self._scan_ends(), direct=True)
                except Exception as e:  # noqa: BLE001
                    self._set_failure(self._store_gone(e))
                finally:
                    self._lock.release()
            if self.failure is not None:
                break
            ended = sorted(self._ended_normally - self.left - {self.rank})
            if ended:  # a peer returned while this rank was still in a collective with it
                return ended[0], ENDED_WHY
            now = time.monotonic()
            if self.world_size == 2 and peer_lost and now >= fallback_at:
                self._set_failure(Failure(1 - self.rank, "its connection closed"))
                break
            if now >= deadline:
                break
            time.sleep(0.2)
        if self.failure is None:
            ended = sorted(self._ended_normally - self.left - {self.rank})
            if ended:
                return ended[0], ENDED_WHY
            return None, ""
        return self.failure.rank, self.failure.why

    # --- ending ---------------------------------------------------------------------------------
    def _message(self) -> str:
        f = self.failure
        if f is not None and f.kind == "mismatch":
            return f.why
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
                    self._say(state)
        except Exception:  # noqa: BLE001
            pass
        finally:
            self._call_since = None

    def _abort(self) -> None:
        """The main thread is stuck (in a collective that cannot be interrupted): end the process."""
        err: CollectiveError
        text = f"{self._message()}; rank {self.rank} was blocked and is stopped (exit code {ABORT_EXIT_CODE})"
        if self.failure is not None and self.failure.kind == "mismatch":
            err = CollectiveMismatchError(text)
        else:
            err = WorkerFailedError(text, rank=self.failure.rank if self.failure else None)
        name = type(err).__name__
        mark_reported()
        sys.stderr.write(f"stratagem: rank {self.rank}: {name}: {err}\n")
        sys.stderr.flush()
        record_followed(f"{name}: {err}", getattr(err, "rank", None))
        self._let_the_verdict_spread()
        self._mark(ABORTED)
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
        # every rank but the silent one (this one counted itself); all of them for a mismatch
        want = self.world_size - (0 if self.failure is not None and self.failure.kind == "mismatch" else 1)
        deadline = time.monotonic() + 2 * self.options.heartbeat_seconds
        while time.monotonic() < deadline:
            # never blocked on the lock: a store call stuck in another thread may hold it
            if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return
            try:
                if int(self._store.add(self._keys.seen(failed), 0)) >= want:
                    return
            except Exception:  # noqa: BLE001 - the store is going: nothing more to wait for
                return
            finally:
                self._lock.release()
            time.sleep(0.05)

    def record_exception(self, exc: BaseException, tb_text: str) -> None:
        """Publish that this rank failed with ``exc`` (its traceback), once."""
        summary = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        rec = {"rank": self.rank, "summary": summary, "traceback": tb_text[-20000:]}
        self._call_since = time.monotonic()  # watched: a store cut off must not hold the exit
        try:
            with self._lock:
                if self._released:  # the store host has ended: nobody is left to read the record
                    return
                publish_record(self._store, self._keys, rec)
                if self._watcher is not None:  # the others read it in the verdict at once
                    self._publish_verdict()
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
                self._mark(ABORTED)
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
                self._mark(FAILED)
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

    def _saw_failure(self) -> Callable[[int], bool]:
        """Whether peer ``p`` has seen this rank's failure: it ended, or every peer has (one
        counter, read once a look)."""
        everyone = int(self._store.add(self._keys.seen(self.rank), 0)) >= sum(
            1 for q in range(self.world_size) if q != self.rank)
        return lambda p: everyone or p in self._finished


def job_probe(monitor: FailureMonitor | None) -> FailureProbe:
    """The probe of a job: the failure monitor's records first, then the launcher's children."""

    def probe(exc: BaseException) -> tuple[int | None, str]:
        rank, why = monitor.probe(exc) if monitor is not None else (None, "")
        return (rank, why) if rank is not None else launcher_probe(exc)

    return probe
