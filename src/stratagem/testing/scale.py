"""Scale by simulation: the real heartbeat and verdict code against a real TCPStore, N simulated ranks in one process.

Each simulated rank makes the calls a ``FailureMonitor`` makes each beat (``Heartbeat.beat``,
``VerdictReader.read``, ``read_records`` when the verdict counts a new record); one simulated rank
is the watcher (``Watcher.read`` of every beat in one ``multi_get``, ``publish_record`` on a rank
newly silent, ``Watcher.publish``). The ranks share a few driver threads, each with its own client
of the store; every call goes through a counting proxy, so the calls a second are counted, not
derived. Faults, one after another, each blamed before the next: a rank ``kill``ed (it makes no
more calls), ``stop``ped (the same, seen from the store: a stopped process runs no code), ``cut``
off (its calls never reach the store), and the watcher killed (the others see its verdict stop).
After each blame the survivors go on without the lost rank (``on_failure="continue"``), as the
monitor's ``continue_without`` does. What is not simulated: pids (a simulated rank has none, so a
peer on its own host is found by its silence, as across hosts), the stall thread, the watchdog's
ending of a blocked process.

``protocol="all-to-all"`` replays the calls of the monitor before issue 49 (its own beat, the
failure counter, then a ``check`` and an ``add`` for every peer: 2N + 2 calls a beat, counted
8 / 32 a beat a rank at N = 4 / 16 with that code), for the "before" column.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from stratagem.comm.heartbeat import (
    Heartbeat,
    Keys,
    local_peers,
    publish_self,
    read_all,
    read_directory,
    write_directory,
)
from stratagem.comm.verdict import (
    Verdict,
    VerdictReader,
    Watcher,
    deputy_of,
    publish_record,
    read_records,
    watcher_of,
)

#: the faults a run applies, in order (each one blamed before the next)
FAULTS = ("kill", "stop", "cut", "kill-watcher")


class CountingStore:
    """A store's proxy that counts every call (shared counter) and can be cut off (its calls
    then raise without reaching the store, as a cut host's would after their timeout)."""

    def __init__(self, inner: Any, counter: list[int], lock: threading.Lock) -> None:
        self._inner, self._counter, self._lock = inner, counter, lock
        self.cut = False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.cut:
                raise TimeoutError("simulated cut: the store cannot be reached")
            with self._lock:
                self._counter[0] += 1
            return method(*args, **kwargs)

        return call


@dataclass
class SimRank:
    """One simulated rank: its heartbeat, its reading of the verdict, what it concluded."""

    rank: int
    store: CountingStore
    keys: Keys
    heartbeat: Heartbeat
    reader: VerdictReader
    state: str = "run"  # run | killed | stopped | cut
    failure: int | None = None
    failure_at: float | None = None
    records_from: int = 0
    left: set[int] = field(default_factory=set)
    #: held by a beat and by ``go_on_without`` (as the monitor's lock is): a beat is never half
    #: before and half after the survivors went on
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tick(self, now: float, watcher: int, deputy: int) -> None:
        """One beat of a rank that is not the watcher: its beat, the verdict, a judgement."""
        with self.lock:
            if self.state in ("killed", "stopped") or self.rank == watcher:
                return
            try:
                self.heartbeat.beat()
                self.judge(self.reader.read(now), now, watcher, deputy)
            except TimeoutError:
                pass  # cut off: nothing reaches the store

    def go_on(self, rank: int, records_from: int) -> None:
        """What ``FailureMonitor.continue_without`` does on a rank that is not the new watcher:
        ``rank`` left, the records so far are read no more, the verdict's clock starts again."""
        with self.lock:
            self.left.add(rank)
            self.records_from = records_from
            self.failure = self.failure_at = None
            self.reader.forget()

    def judge(self, verdict: Verdict | None, now: float, watcher: int, deputy: int) -> None:
        """What the verdict says (the records it counts; the watcher's silence), as
        ``FailureMonitor._detect`` reads it; only the deputy records a silent watcher."""
        if self.failure is not None or verdict is None:
            return
        for rec in read_records(self.store, self.keys, self.records_from, verdict.nfail):
            if int(rec["rank"]) not in self.left and int(rec["rank"]) != self.rank:
                self._conclude(int(rec["rank"]))
                return
        if watcher != self.rank and self.reader.watcher_silent(now):
            self._conclude(watcher)
            if self.rank == deputy:
                publish_record(self.store, self.keys, {"rank": watcher, "why": "its verdict stopped",
                                                       "silent": True, "by": self.rank})

    def _conclude(self, rank: int) -> None:
        self.failure, self.failure_at = rank, time.monotonic()


@dataclass(frozen=True)
class Blame:
    fault: str
    rank: int
    seconds: float | None  # until every live rank named it (None: not within the wait)
    named_right: bool


@dataclass(frozen=True)
class ScaleResult:
    """One simulated job's figures."""

    n: int
    protocol: str
    heartbeat_seconds: float
    calls_per_second: float
    calls_per_beat_per_rank: float
    age_p99: float
    startup_seconds: float
    startup_calls: int
    false_failures: int
    blames: tuple[Blame, ...]

    def row(self) -> str:
        blames = " ".join(
            f"{b.fault}={'-' if b.seconds is None else f'{b.seconds:.1f}s'}{'' if b.named_right else '(WRONG)'}"
            for b in self.blames)
        return (f"{self.n:>5} {self.protocol:>10} {self.calls_per_second:>10.0f} {self.calls_per_beat_per_rank:>9.2f} "
                f"{self.age_p99:>8.2f} {self.startup_seconds:>8.2f} {self.startup_calls:>8} "
                f"{self.false_failures:>6}  {blames}")


HEADER = (f"{'N':>5} {'protocol':>10} {'calls/s':>10} {'/beat/rk':>9} {'age p99':>8} {'start s':>8} "
          f"{'start #':>8} {'false':>6}  blame after each fault")


class _Job:
    """N simulated ranks on ``drivers`` threads against one TCPStore (the ranks' own calls only)."""

    def __init__(self, n: int, port: int, heartbeat: float, dead_after: float, drivers: int,
                 hosts_of: int, protocol: str) -> None:
        self.n, self.heartbeat, self.dead_after, self.protocol = n, heartbeat, dead_after, protocol
        self.counter = [0]
        self._count_lock = threading.Lock()
        self.keys = Keys("stratagem/scale/")
        # one client a driver, and one of its own for the watcher (its start-up wait must not
        # queue behind a driver's wait for the directory on a shared connection)
        self.clients = [dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=30)) for _ in range(drivers + 1)]
        self.ranks: list[SimRank] = []
        for r in range(n):
            client = self.clients[drivers] if r == 0 else self.clients[r % drivers]
            store = CountingStore(client, self.counter, self._count_lock)
            self.ranks.append(SimRank(r, store, self.keys, Heartbeat(store, self.keys, r),
                                      VerdictReader(store, self.keys, dead_after)))
        self.slices = [self.ranks[i::drivers] for i in range(drivers)]
        self.hosts_of = hosts_of
        self.left: set[int] = set()
        self.watcher_rank = 0
        self.watcher: Watcher | None = None
        self.ages: list[float] = []
        self.beats = [0]  # beats made by all ranks (the watcher's included)
        self.last_beat: dict[int, float] = {}
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    # --- start-up: what FailureMonitor.start does, for every rank -------------------------------
    def start_up(self) -> tuple[float, int]:
        before, t0 = self.counter[0], time.monotonic()
        threads = [threading.Thread(target=self._start_slice, args=(s,)) for s in self.slices]
        threads.append(threading.Thread(target=self._start_watcher))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0, self.counter[0] - before

    def _me(self, r: int) -> tuple[str, int, str]:
        return (f"sim-host-{r // self.hosts_of}", 100000 + r, f"10.0.{r // self.hosts_of}.1")

    def _start_slice(self, ranks: list[SimRank]) -> None:
        for sim in ranks:
            publish_self(sim.store, self.keys, sim.rank, self._me(sim.rank), sim.heartbeat)
        if self.protocol != "verdict":  # the old start-up: every rank read every peer's record
            for sim in ranks:
                others = [self.keys.pid(r) for r in range(self.n) if r != sim.rank]
                sim.store.wait(others, datetime.timedelta(seconds=60))
                for key in others:
                    sim.store.get(key)
            return
        for sim in ranks:
            if sim.rank == self.watcher_rank:
                continue
            read_directory(sim.store, self.keys, 60.0)
            local_peers(sim.store.get(self.keys.host(self._me(sim.rank)[0])))

    def _start_watcher(self) -> None:
        if self.protocol != "verdict":
            return
        sim = self.ranks[self.watcher_rank]
        self.watcher = Watcher(sim.store, self.keys, sim.rank, self.dead_after)
        peers = read_all(sim.store, self.keys, [r for r in range(self.n) if r != sim.rank], 60.0)
        write_directory(sim.store, self.keys, peers, "127.0.0.1")
        self.watcher.publish()

    # --- running --------------------------------------------------------------------------------
    def run(self) -> None:
        self.threads = [threading.Thread(target=self._drive, args=(s,), daemon=True) for s in self.slices]
        if self.protocol == "verdict":
            self.threads.append(threading.Thread(target=self._watch, daemon=True))
        for t in self.threads:
            t.start()

    def halt(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)

    def _drive(self, ranks: list[SimRank]) -> None:
        next_at = time.monotonic()
        while not self.stop.is_set():
            for sim in ranks:
                if self.protocol == "verdict":
                    if sim.state == "run" and sim.rank != self.watcher_rank:
                        self.beats[0] += 1
                    sim.tick(time.monotonic(), self.watcher_rank, self.deputy)
                else:
                    self._all_to_all_tick(sim)
            next_at += self.heartbeat
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def _all_to_all_tick(self, sim: SimRank) -> None:
        """The per-beat calls of the monitor before issue 49."""
        if sim.state != "run":
            return
        now = time.monotonic()
        last = self.last_beat.get(sim.rank)
        if last is not None:
            self.ages.append(now - last)  # what its peers see: the time between its beats
        self.last_beat[sim.rank] = now
        self.beats[0] += 1
        s, k = sim.store, self.keys
        s.add(k.of("hb", sim.rank), 1)
        s.add(k.nfail, 0)
        for p in range(self.n):
            if p != sim.rank:
                s.check([k.of("end", p)])
                s.add(k.of("hb", p), 0)

    def _watch(self) -> None:
        next_at = time.monotonic()
        while not self.stop.is_set():
            w = self.watcher
            sim = self.ranks[w.rank] if w is not None else None
            if w is not None and sim is not None and sim.state == "run":
                now = time.monotonic()
                sim.heartbeat.beat()
                self.beats[0] += 1
                members = [r for r in range(self.n) if r != w.rank and r not in self.left]
                w.read(members, now)
                self.ages.extend(w.book.age(r, now) for r in members if self.ranks[r].state == "run")
                for p in w.newly_silent(now, set(self.left)):
                    publish_record(sim.store, self.keys, {"rank": p, "why": "no beat", "silent": True, "by": w.rank})
                sim.judge(w.publish(), now, w.rank, self.deputy)
            next_at += self.heartbeat / 2  # twice a beat: a silence is seen within half a beat
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    @property
    def deputy(self) -> int:
        return deputy_of([s.rank for s in self.ranks if s.rank not in self.left], self.watcher_rank)

    # --- faults ---------------------------------------------------------------------------------
    def live(self) -> list[SimRank]:
        return [s for s in self.ranks if s.state == "run" and s.rank not in self.left]

    def fault(self, kind: str, rank: int) -> None:
        sim = self.ranks[rank]
        if kind in ("kill", "kill-watcher"):
            sim.state = "killed"
        elif kind == "stop":
            sim.state = "stopped"
        else:
            sim.state, sim.store.cut = "cut", True

    def go_on_without(self, rank: int) -> None:
        """What the survivors do once they agreed on the loss: the rank leaves, records so far
        are read no more, a new watcher when the watcher left."""
        self.left.add(rank)
        count = int(self.ranks[self.live()[0].rank].store.add(self.keys.nfail, 0))
        for sim in self.live():
            sim.go_on(rank, count)
        if rank == self.watcher_rank:
            self.watcher_rank = watcher_of([s.rank for s in self.live()], None)
            sim = self.ranks[self.watcher_rank]
            self.watcher = Watcher(sim.store, self.keys, sim.rank, self.dead_after)
            self.watcher.publish()
        elif self.watcher is not None:
            self.watcher.forget({rank})


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@contextlib.contextmanager
def _store_server() -> Iterator[tuple[Any, int]]:
    from stratagem.cluster import find_free_port

    port = find_free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    try:
        yield server, port
    finally:
        del server


def simulate(
    n: int,
    *,
    seconds: float = 10.0,
    heartbeat_seconds: float = 1.0,
    dead_after_seconds: float = 6.0,
    faults: tuple[str, ...] = FAULTS,
    drivers: int = 8,
    ranks_per_host: int = 8,
    protocol: str = "verdict",
) -> ScaleResult:
    """Run ``n`` simulated ranks for ``seconds`` without a fault (counting calls and false
    failures), then apply ``faults`` one after another, each timed until every live rank names it."""
    if protocol not in ("verdict", "all-to-all"):
        raise ValueError(f"simulate: protocol must be 'verdict' or 'all-to-all', got {protocol!r}")
    with _store_server() as (_server, port):
        job = _Job(n, port, heartbeat_seconds, dead_after_seconds, min(drivers, n), ranks_per_host, protocol)
        startup_s, startup_calls = job.start_up()
        job.run()
        try:
            time.sleep(min(2 * heartbeat_seconds, seconds / 4))  # settle: every clock has a first beat
            c0, b0, t0 = job.counter[0], job.beats[0], time.monotonic()
            job.ages.clear()
            time.sleep(seconds)
            calls, beats, span = job.counter[0] - c0, job.beats[0] - b0, time.monotonic() - t0
            end = time.monotonic()
            job.ages.extend(end - t for t in job.last_beat.values())  # a beat still awaited
            false = sum(1 for s in job.ranks if s.failure is not None)
            age = _p99(job.ages)
            blames = tuple(_blame(job, kind, dead_after_seconds, heartbeat_seconds) for kind in faults) \
                if protocol == "verdict" else ()
        finally:
            job.halt()
        for client in job.clients:
            del client
    rate = calls / span
    return ScaleResult(n, protocol, heartbeat_seconds, rate, calls / max(beats, 1), age,
                       startup_s, startup_calls, false, blames)


def _blame(job: _Job, kind: str, dead_after: float, heartbeat: float) -> Blame:
    live = job.live()
    if kind == "kill-watcher":
        rank = job.watcher_rank
    else:  # a rank in the middle of the job, not the watcher
        rank = next(s.rank for s in itertools.chain(live[len(live) // 2:], live) if s.rank != job.watcher_rank)
    at = time.monotonic()
    job.fault(kind, rank)
    deadline = at + dead_after + 6 * heartbeat + 5.0
    others = [s for s in job.live() if s.rank != rank]
    while time.monotonic() < deadline and any(s.failure is None for s in others):
        time.sleep(0.05)
    seen = [s for s in others if s.failure is not None]
    right = all(s.failure == rank for s in seen)
    seconds = max(s.failure_at for s in seen if s.failure_at is not None) - at \
        if len(seen) == len(others) else None
    job.go_on_without(rank)
    return Blame(kind, rank, seconds, right)
