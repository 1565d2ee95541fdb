"""Verdicts: one watcher reads every beat in one call and publishes the job's verdict; failure records; explaining a failed collective."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from stratagem.cluster.launch import children
from stratagem.comm.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    WorkerFailedError,
    looks_like_peer_loss,
)
from stratagem.comm.heartbeat import BeatBook, Keys
from stratagem.comm.sequence import MISMATCH_WHY


@dataclass(frozen=True)
class Verdict:
    """What the watcher published: its pass count (``seq``: that it is alive), who it is, how many
    failure records the job has (``nfail``), the ranks whose programs ended, and which of them
    ended normally (``done``: returned or exited with 0, not raised or aborted)."""

    seq: int
    by: int
    nfail: int
    ended: tuple[int, ...] = ()
    done: tuple[int, ...] = ()

    def encode(self) -> str:
        return json.dumps({"seq": self.seq, "by": self.by, "nfail": self.nfail, "ended": list(self.ended),
                           "done": list(self.done)})

    @staticmethod
    def decode(raw: bytes | str) -> Verdict:
        d = json.loads(raw)
        return Verdict(int(d["seq"]), int(d["by"]), int(d["nfail"]), tuple(int(r) for r in d.get("ended", ())),
                       tuple(int(r) for r in d.get("done", ())))


def watcher_of(members: list[int] | set[int], store_host_rank: int | None) -> int:
    """The rank that watches the job: the store's host (it lives as long as the store), else the
    lowest member."""
    if store_host_rank is not None and store_host_rank in members:
        return store_host_rank
    return min(members)


def deputy_of(members: list[int] | set[int], watcher: int) -> int:
    """The rank that records the watcher's silence (one record, not one a rank): the lowest
    other member."""
    return min((m for m in members if m != watcher), default=watcher)


def publish_record(store: Any, keys: Keys, record: dict[str, Any]) -> int:
    """One failure record (a rank's own error, or a verdict on a peer); returns its number."""
    n = int(store.add(keys.nfail, 1))
    store.set(keys.fail(n), json.dumps(record))
    return n


def read_records(store: Any, keys: Keys, after: int, upto: int) -> list[dict[str, Any]]:
    """Failure records ``after+1 .. upto`` (those present)."""
    out = []
    for i in range(after + 1, upto + 1):
        key = keys.fail(i)
        if store.check([key]):
            out.append(dict(json.loads(store.get(key))))
    return out


@dataclass
class Watcher:
    """The job's one watcher: each pass reads every member's beat in one ``multi_get``, records
    a verdict on each rank newly silent for ``dead_after`` seconds, and publishes the verdict
    (three store calls a pass, whatever the job's size)."""

    store: Any
    keys: Keys
    rank: int
    dead_after: float
    book: BeatBook = field(default_factory=BeatBook)
    seq: int = 0
    published: set[int] = field(default_factory=set)

    def read(self, members: list[int], now: float) -> None:
        if members:
            values = self.store.multi_get([self.keys.beat(r) for r in members])
            for r, v in zip(members, values, strict=True):
                self.book.see(r, v, now)

    def newly_silent(self, now: float, skip: set[int]) -> list[int]:
        found = [r for r in self.book.silent(now, self.dead_after, skip | {self.rank}) if r not in self.published]
        self.published.update(found)
        return found

    def publish(self, nfail: int | None = None) -> Verdict:
        self.seq += 1
        count = int(self.store.add(self.keys.nfail, 0)) if nfail is None else nfail
        verdict = Verdict(self.seq, self.rank, count, tuple(self.book.ended()), tuple(self.book.ended_normally()))
        self.store.set(self.keys.verdict, verdict.encode())
        return verdict

    def forget(self, ranks: set[int] | None = None) -> None:
        self.book.forget(ranks)
        if ranks is not None:
            self.published -= ranks


@dataclass
class VerdictReader:
    """A rank's side: one ``get`` of the verdict a beat; the watcher is taken for silent when its
    verdict did not change for ``dead_after`` seconds."""

    store: Any
    keys: Keys
    dead_after: float
    last: Verdict | None = None
    changed_at: float = 0.0

    def read(self, now: float) -> Verdict | None:
        if self.last is None and not self.store.check([self.keys.verdict]):
            return None  # no watcher has published yet (a get would wait for it)
        verdict = Verdict.decode(self.store.get(self.keys.verdict))
        if self.last is None or verdict.seq != self.last.seq or verdict.by != self.last.by:
            self.changed_at = now
        self.last = verdict
        return verdict

    def watcher_silent(self, now: float) -> bool:
        return self.last is not None and now - self.changed_at >= self.dead_after

    def forget(self) -> None:
        """Its clock starts again (this process was stopped or starved, or the watcher changed)."""
        self.last = None


# --- explaining a failed collective ----------------------------------------------------------------
#: what a probe says of a peer whose program ended normally while this rank was still in a
#: collective with it (``classify_failure`` words the error for it)
ENDED_WHY = "its program ended normally (it returned or exited with code 0)"
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
    if why.startswith(MISMATCH_WHY):
        return CollectiveMismatchError(f"{op} failed: {why} ({text})")
    if why == ENDED_WHY:
        return WorkerFailedError(
            f"{op} failed because {who} ended its program normally (it returned or exited with code 0) "
            "while this worker was still in a collective with it, which it never joined. Every replica "
            "must run the same steps and collectives "
            f"(strategy.run, strategy.reduce, fit's epochs and steps) ({text})", rank=rank)
    detail = f": {why}" if why else ""
    return WorkerFailedError(f"{op} failed because {who} failed{detail} ({text})", rank=rank)
