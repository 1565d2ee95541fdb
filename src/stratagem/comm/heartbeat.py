"""Heartbeats: one key per process in the job's store, a book of their ages, and the start-up directory."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: the states a process's beat carries: running, or how its program ended
RUNNING, DONE, FAILED, ABORTED, RELEASED = "run", "done", "failed", "aborted", "released"
#: states after which a process makes no more beats (it is not silent, it ended)
ENDED = frozenset({DONE, FAILED, ABORTED, RELEASED})
#: states of a program that ended normally (it returned or exited with 0; ``RELEASED``: it ended
#: after the store's host did), as against one that raised or was aborted
ENDED_NORMALLY = frozenset({DONE, RELEASED})


@dataclass(frozen=True)
class Keys:
    """The store keys of one job's control plane (all under ``prefix``)."""

    prefix: str = "stratagem/failure/"

    def of(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def beat(self, rank: int) -> str:
        return self.of("beat", rank)

    def pid(self, rank: int) -> str:
        return self.of("pid", rank)

    def host(self, identity: str) -> str:
        return self.of("host", hashlib.sha1(identity.encode()).hexdigest()[:16])

    @property
    def directory(self) -> str:
        return self.of("directory")

    @property
    def verdict(self) -> str:
        return self.of("verdict")

    @property
    def nfail(self) -> str:
        return self.of("nfail")

    def fail(self, n: int) -> str:
        return self.of("fail", n)

    def seen(self, rank: int | None) -> str:
        return self.of("seen", rank)


def encode_beat(n: int, state: str, where: str | None = None) -> str:
    """A beat's value: its count, the process's state and, while it waits in a collective, which
    one (``"12 run"``, ``"13 run 57:all_reduce/float32[10]"``: ``comm.sequence.Position``)."""
    return f"{n} {state}" if not where else f"{n} {state} {where}"


def decode_beat(raw: bytes | str) -> tuple[int, str]:
    n, state, _ = decode_beat_where(raw)
    return n, state


def decode_beat_where(raw: bytes | str) -> tuple[int, str, str]:
    """A beat's count, state and collective position ("" when it waits in none)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    n, _, rest = text.partition(" ")
    state, _, where = rest.partition(" ")
    return int(n), state or RUNNING, where


class Heartbeat:
    """This process's beat: one ``set`` of its own key per beat, carrying its state."""

    def __init__(self, store: Any, keys: Keys, rank: int) -> None:
        self.store, self.keys, self.rank = store, keys, rank
        self.count = 0
        self.state = RUNNING
        #: the collective this process waits in, encoded (None: it says none)
        self.where: Callable[[], str | None] | None = None

    def beat(self, state: str | None = None) -> None:
        if state is not None:
            self.state = state
        self.count += 1
        where = self.where() if self.where is not None and self.state == RUNNING else None
        self.store.set(self.keys.beat(self.rank), encode_beat(self.count, self.state, where))


@dataclass
class BeatBook:
    """When each watched rank's beat last changed (the watcher's, on its own clock)."""

    beats: dict[int, tuple[int, float]] = field(default_factory=dict)
    states: dict[int, str] = field(default_factory=dict)
    #: the collective each rank said it waits in at its last beat ("" none)
    wheres: dict[int, str] = field(default_factory=dict)

    def see(self, rank: int, raw: bytes | str, now: float) -> None:
        n, state, where = decode_beat_where(raw)
        self.states[rank] = state
        self.wheres[rank] = where
        last = self.beats.get(rank)
        if last is None or last[0] != n:
            self.beats[rank] = (n, now)

    def age(self, rank: int, now: float) -> float:
        last = self.beats.get(rank)
        return 0.0 if last is None else now - last[1]

    def ended(self) -> list[int]:
        return sorted(r for r, s in self.states.items() if s in ENDED)

    def ended_normally(self) -> list[int]:
        return sorted(r for r, s in self.states.items() if s in ENDED_NORMALLY)

    def silent(self, now: float, dead_after: float, skip: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """The ranks still running whose beat has not changed for ``dead_after`` seconds."""
        return sorted(
            r for r, (_, t) in self.beats.items()
            if r not in skip and self.states.get(r) not in ENDED and now - t >= dead_after
        )

    def forget(self, ranks: set[int] | None = None) -> None:
        """Start the clocks again (all of them, or ``ranks``'): the watcher was starved or stopped,
        or those ranks came back."""
        for r in list(self.beats) if ranks is None else ranks:
            self.beats.pop(r, None)
            self.wheres.pop(r, None)
            if ranks is not None:
                self.states.pop(r, None)


# --- who runs where ---------------------------------------------------------------------------


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


#: (host identity, pid, address) of one rank
Peer = tuple[str, int, str]


def peer_record(raw: Any) -> Peer:
    info = json.loads(raw)
    return str(info["host"]), int(info["pid"]), str(info.get("address", ""))


def publish_self(store: Any, keys: Keys, rank: int, me: Peer, beat: Heartbeat) -> None:
    """Start-up, every rank: its entry in its host's list, its first beat, then its record (3
    calls; a record present means the other two are)."""
    host, pid, address = me
    store.append(keys.host(host), f"{rank}:{pid};")
    beat.beat()
    store.set(keys.pid(rank), json.dumps({"host": host, "pid": pid, "address": address}))


def local_peers(raw: bytes | str) -> dict[int, int]:
    """rank -> pid of the processes of one host, from its list (a rank listed again: the last)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    out: dict[int, int] = {}
    for item in filter(None, text.split(";")):
        r, _, pid = item.partition(":")
        out[int(r)] = int(pid)
    return out


def read_all(store: Any, keys: Keys, ranks: list[int], timeout: float) -> dict[int, Peer]:
    """The watcher at start-up: every rank's record, in one wait and one ``multi_get`` (the ranks
    that have not published within ``timeout``: checked one by one and left out)."""
    names = [keys.pid(r) for r in ranks]
    try:
        store.wait(names, datetime.timedelta(seconds=timeout))
        present = ranks
    except Exception:  # noqa: BLE001 - a rank gone at start-up: the others are read
        present = [r for r in ranks if store.check([keys.pid(r)])]
    if not present:
        return {}
    values = store.multi_get([keys.pid(r) for r in present])
    return {r: peer_record(v) for r, v in zip(present, values, strict=True)}


def write_directory(store: Any, keys: Keys, peers: dict[int, Peer], store_addr: str) -> None:
    """The watcher at start-up: what every rank needs of the others, in one key: which ranks run
    at the store's address (to name the host of a store that cannot be reached)."""
    near = sorted(r for r, (_, _, address) in peers.items() if address == store_addr)
    store.set(keys.directory, json.dumps({"near": near, "at": time.time()}))


def read_directory(store: Any, keys: Keys, timeout: float) -> dict[str, Any] | None:
    """Every rank at start-up: the watcher's directory (None when it did not come in time)."""
    try:
        store.wait([keys.directory], datetime.timedelta(seconds=timeout))
        return dict(json.loads(store.get(keys.directory)))
    except Exception:  # noqa: BLE001 - the watcher is gone or slow: the beats decide
        return None
