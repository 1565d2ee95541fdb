"""Who is left after a replica is lost: the survivors agree through the job's store.

With ``FailureOptions(on_failure="continue")`` a lost replica does not end the job: each survivor
whose collective failed says so in the store (with what it reports: how far it got), and the
leader (the lowest rank of the previous membership: the store's own host under self-launch and
TF_CONFIG, so it is alive whenever the store is) waits until every previous member has either
said so or is known gone (``gone``: its process ended, a record of its failure, no heartbeat),
then writes the decision once. Everyone reads the same decision, so the survivors agree on the
members and on every member's report; a process that arrives after the decision (it was taken
for gone) is not a member and is told so. One round per ``generation``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stratagem.comm.communicator import await_keys
from stratagem.comm.errors import CollectiveError


class LeftOutError(CollectiveError):
    """This process was taken for lost: the others went on without it."""


@dataclass(frozen=True)
class Membership:
    """The agreed members (the ranks the job started with, sorted), this round's number, and what
    each member reported."""

    generation: int
    members: tuple[int, ...]
    reports: dict[int, Any]

    def rank_of(self, launch_rank: int) -> int:
        """A member's rank in the new process group (its place among the members)."""
        return self.members.index(launch_rank)


def _key(generation: int, *parts: object) -> str:
    return f"stratagem/members/{generation}/" + "/".join(str(p) for p in parts)


def agree(
    store: Any,
    generation: int,
    me: int,
    previous: Sequence[int],
    report: Any,
    *,
    gone: Callable[[int], bool],
    timeout: float,
    poll: float = 0.02,
) -> Membership:
    """The members after a failure, the same on every survivor (see the module's docstring).

    ``previous``: the members before it (sorted); ``report``: this process's JSON-able report;
    ``gone(rank)``: whether a previous member is known to be out of the job. A member that neither
    arrives nor is known gone is waited for up to ``timeout`` seconds (it may still be computing
    before the collective that fails), then taken for gone."""
    if me not in previous:
        raise LeftOutError(f"replica {me} is not a member of the job any more (members: {list(previous)})")
    store.set(_key(generation, "in", me), json.dumps(report))
    decided = _key(generation, "decided")
    deadline = time.monotonic() + timeout
    # the leader is the lowest member not known gone: the store's host where a replica hosts it
    # (alive whenever the store is); where the store is outside the replicas (a store keeper)
    # the lowest may be the one lost, and the next takes over. A decision is written once
    # (compare_set): two that both took themselves for the leader cannot decide differently.
    # A member that is not the leader waits for the decision, looking again whether the leader
    # is gone every quarter second (one member at a time: not a look at every member per poll).
    candidates = [m for m in previous if m <= me]
    while True:
        while candidates[0] != me and gone(candidates[0]):
            candidates.pop(0)
        leader = candidates[0]
        if leader == me:
            if not store.check([decided]):
                _lead(store, generation, previous, gone, deadline, poll)
            break
        if not await_keys(store, [decided], min(0.25, max(deadline - time.monotonic(), 0.0))):
            break
        if time.monotonic() >= deadline:
            raise CollectiveError(
                f"replica {me}: replica {leader}, which decides who is left after a failure, did not "
                f"decide within {timeout:g}s; the job cannot go on"
            )
    membership = _decision(store, generation)
    members = membership.members
    if me not in members:
        raise LeftOutError(
            f"replica {me} was taken for lost (it reached the others {timeout:g}s after they noticed "
            f"the failure, or was reported failed); the job went on with replicas {list(members)} "
            "without it, so this process ends"
        )
    return membership


def _lead(
    store: Any, generation: int, previous: Sequence[int], gone: Callable[[int], bool], deadline: float, poll: float
) -> None:
    """The leader's part of a round: wait until every previous member arrived or is known gone
    (or the deadline), then decide (unless another decided first)."""
    while True:
        arrived = [m for m in previous if store.check([_key(generation, "in", m)])]
        pending = [m for m in previous if m not in arrived and not gone(m)]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll)
    reports = {m: json.loads(store.get(_key(generation, "in", m))) for m in arrived}
    _decide(store, generation, arrived, reports)


def _decision(store: Any, generation: int) -> Membership:
    raw = json.loads(store.get(_key(generation, "decided")))
    return Membership(generation, tuple(int(m) for m in raw["members"]), {int(m): r for m, r in raw["reports"].items()})


CURRENT = "stratagem/members/current"


def _decide(store: Any, generation: int, members: Sequence[int], reports: dict[int, Any]) -> None:
    """Write round ``generation``'s decision once: a decision already there is kept (the round's
    one answer), and the job's current membership is the one kept."""
    value = json.dumps({"members": list(members), "reports": {str(m): r for m, r in reports.items()}})
    kept = store.compare_set(_key(generation, "decided"), "", value)
    if isinstance(kept, bytes):
        kept = kept.decode()
    members = json.loads(kept)["members"]
    store.set(CURRENT, json.dumps({"generation": generation, "members": list(members)}))


def current(store: Any) -> tuple[int, tuple[int, ...]] | None:
    """The job's membership after its last change (generation, members); None: it never changed."""
    if not store.check([CURRENT]):
        return None
    raw = json.loads(store.get(CURRENT))
    return int(raw["generation"]), tuple(int(m) for m in raw["members"])


# --- a replica that comes back -------------------------------------------------------------------
def _join_key(rank: int) -> str:
    return f"stratagem/join/{rank}"


def _admitted_key(rank: int) -> str:
    return f"stratagem/admitted/{rank}"


def request_join(store: Any, me: int) -> None:
    """Ask to be let in again (a new process in the place of lost rank ``me``)."""
    with contextlib.suppress(Exception):
        store.delete_key(_admitted_key(me))
    store.set(_join_key(me), "1")


def joins_pending(store: Any, absent: Sequence[int]) -> list[int]:
    """Which of the ``absent`` ranks asked to come back (one store call per absent rank)."""
    return [r for r in absent if store.check([_join_key(r)])]


def admit(store: Any, generation: int, members: Sequence[int], joiners: Sequence[int]) -> Membership:
    """The leader lets ``joiners`` in: the new membership (``members`` and them) as round
    ``generation``'s decision, and each joiner told which round admitted it."""
    everyone = tuple(sorted({*members, *joiners}))
    _decide(store, generation, everyone, {})
    for r in joiners:
        store.delete_key(_join_key(r))
        store.set(_admitted_key(r), str(generation))
    return Membership(generation, everyone, {})


def admitted(store: Any, generation: int, timeout: float) -> Membership:
    """Round ``generation``'s decision (a survivor that is not the leader reads it)."""
    if await_keys(store, [_key(generation, "decided")], timeout):
        raise CollectiveError(f"the decision of membership round {generation} did not come within {timeout:g}s")
    return _decision(store, generation)


CLOSED = "stratagem/members/closed"


class TrainingEndedError(CollectiveError):
    """A replica came back after the job's training had ended: there is nothing left for it."""


def close(store: Any) -> None:
    """The leader's fit ended: a replica still waiting to be let in is told so."""
    store.set(CLOSED, "1")


def reopen(store: Any) -> None:
    """The leader's fit began (again): replicas may be let in."""
    with contextlib.suppress(Exception):
        store.delete_key(CLOSED)


def wait_admitted(store: Any, me: int, timeout: float, poll: float = 0.05) -> Membership:
    """A joiner waits (up to ``timeout``) until the leader lets it in at a step boundary; a
    ``TrainingEndedError`` when the leader's fit ended first."""
    deadline = time.monotonic() + timeout
    while not store.check([_admitted_key(me)]):
        if store.check([CLOSED]):
            raise TrainingEndedError(
                f"replica {me} was started again after the job's training had ended; there is "
                "nothing left for it to do"
            )
        if time.monotonic() >= deadline:
            raise CollectiveError(
                f"replica {me} asked to rejoin the job but was not let in within {timeout:g}s (the "
                "others let a replica in between two training steps of fit, under on_failure='continue')"
            )
        time.sleep(poll)
    generation = int(store.get(_admitted_key(me)))
    return admitted(store, generation, timeout)
