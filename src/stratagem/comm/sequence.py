"""The job's collective sequence: each process numbers the collectives it makes over the job's group
and says, in its heartbeat, which one it is waiting in, so that replicas making different
collectives (``if sg.is_chief(): strategy.reduce(...)``) are told apart within a beat or two
instead of waiting out the backend's timeout.

Every replica makes the same collectives in the same order, so the n-th collective of one replica
pairs with the n-th of every other: two replicas found waiting in their n-th collective with
different operations, dtypes or sizes can never finish it. The position costs no store call of
its own: it rides in the beat a process writes anyway, and the watcher compares the positions it
reads in its one ``multi_get`` (``disagreement``). Only collectives every member makes are
numbered (not send/recv).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

#: what the watcher's record of a disagreement starts with (``classify_failure`` and the monitor
#: word the error for it)
MISMATCH_WHY = "the replicas are waiting in different collectives"


@dataclass(frozen=True)
class Position:
    """The collective a process waits in: its number in the job's sequence, what it is
    (``"all_reduce float32[10]"``), and how many times this process's group was formed again
    before it (positions of different groups are never compared)."""

    seq: int
    what: str
    group: int = 0

    def encode(self) -> str:
        return f"{self.group}.{self.seq}:{self.what.replace(' ', '/')}"

    @staticmethod
    def decode(text: str) -> Position | None:
        where, sep, what = text.partition(":")
        group, dot, seq = where.partition(".")
        if not sep or not dot or not group.isdigit() or not seq.isdigit():
            return None
        return Position(int(seq), what.replace("/", " "), int(group))


def describe(op: str, tensor: torch.Tensor | None = None, *, sized: bool = True) -> str:
    """A collective as the sequence names it: the operation, and the dtype and element count
    that every member's call must match (``sized=False``: dtype only, e.g. all_to_all's splits
    differ by rank)."""
    if tensor is None:
        return op
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{op} {dtype}[{tensor.numel()}]" if sized else f"{op} {dtype}"


class CollectiveLog:
    """One communicator's numbered collectives and which of them this process waits in now."""

    def __init__(self) -> None:
        self._seq = 0
        self._group = 0
        self._waiting: dict[int, str] = {}
        self._lock = threading.Lock()

    def start(self) -> int:
        """Number the next collective (every member numbers its own alike)."""
        with self._lock:
            self._seq += 1
            return self._seq

    @contextlib.contextmanager
    def waiting(self, seq: int, what: str) -> Iterator[None]:
        """This process waits in collective ``seq`` meanwhile."""
        with self._lock:
            self._waiting[seq] = what
        try:
            yield
        finally:
            with self._lock:
                self._waiting.pop(seq, None)

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """A collective that starts and is waited for in one call."""
        with self.waiting(self.start(), what):
            yield

    def position(self) -> Position | None:
        """The oldest collective this process waits in (None: none)."""
        with self._lock:
            if not self._waiting:
                return None
            seq = min(self._waiting)
            return Position(seq, self._waiting[seq], self._group)

    def reset(self) -> None:
        """The group was formed again (every member starts numbering afresh)."""
        with self._lock:
            self._seq = 0
            self._group += 1
            self._waiting.clear()


def disagreement(positions: dict[int, Position]) -> tuple[int, dict[str, list[int]]] | None:
    """The first collective number at which ranks of one group wait in different collectives,
    with the ranks waiting in each (None: no disagreement)."""
    by_seq: dict[tuple[int, int], dict[str, list[int]]] = {}
    for rank, pos in sorted(positions.items()):
        by_seq.setdefault((pos.group, pos.seq), {}).setdefault(pos.what, []).append(rank)
    for key in sorted(by_seq):
        if len(by_seq[key]) > 1:
            return key[1], by_seq[key]
    return None


def odd_one(by_what: dict[str, list[int]]) -> int:
    """The rank to name: the first rank of the smallest group (its collective is the odd one)."""
    smallest = min(by_what.values(), key=lambda ranks: (len(ranks), -min(ranks)))
    return min(smallest)


def explain(seq: int, by_what: dict[str, list[int]]) -> str:
    """The words of a disagreement."""
    parts = "; ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} in {what}"
        for what, ranks in sorted(by_what.items(), key=lambda kv: kv[1])
    )
    return (f"{MISMATCH_WHY} (collective #{seq} of the job: {parts}), so none can finish. Every "
            "replica must make the same collectives in the same order: a strategy.reduce, "
            "all-reduce or check made on some replicas only (e.g. under `if sg.is_chief():`) must "
            "be made on every replica")
