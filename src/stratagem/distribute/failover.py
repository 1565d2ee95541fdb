"""Going on without a lost replica (``FailureOptions(on_failure="continue")``): the job's side.

After a collective failed because a replica died or raised, each survivor: closes its process
group (a survivor still blocked in a collective with it fails at once), agrees with the others on
who is left (``comm/membership.agree``, through the job's store), forms the process group again
over the survivors (``join.regroup``: torch's ``init_process_group`` under a fresh store prefix;
the job's communicator is re-pointed, so every holder follows) and tells the failure monitor to
stop watching the lost ones. What the training loop does with it (whose state to take, where the
data stands) is ``train/failover.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Any

from stratagem.comm.errors import CollectiveError
from stratagem.comm.failure import FailureOptions
from stratagem.comm.membership import (
    Membership,
    TrainingEndedError,
    admit,
    admitted,
    agree,
    close,
    joins_pending,
    reopen,
    request_join,
    wait_admitted,
)
from stratagem.distribute.join import (
    coming_back,
    failure_monitor,
    job_timeout,
    joined_store,
    launch_rank,
    launch_world,
    leave_group,
    let_in,
    regroup,
)

log = logging.getLogger("stratagem")


class Survivors:
    """The membership of a job that goes on without lost replicas, round after round."""

    def __init__(self, world_size: int, options: FailureOptions, timeout: float | None = None) -> None:
        self.world = launch_world() or world_size
        self.members: tuple[int, ...] = tuple(range(self.world))
        self.generation = 0
        self.options = options
        self.timeout = job_timeout() if timeout is None else timeout
        #: seconds each round took, from the failed collective to the new group (for the figures)
        self.rounds: list[float] = []

    def go_on(self, error: CollectiveError, report: Any) -> Membership:
        """After ``error`` (a failed collective): the agreed members, with the new process group
        formed over them; ``report`` is this process's (JSON-able) say in the round. Raises a
        clear error when the job cannot go on (the store's host is gone, this process was left
        out, the last replica is lost)."""
        start = time.monotonic()
        me, store, monitor = launch_rank(), joined_store(), failure_monitor()
        if me is None or store is None or monitor is None:
            raise CollectiveError(
                "on_failure='continue' needs the job's store and failure monitor (a job stratagem "
                "formed, with FailureOptions(enabled=True))"
            ) from error
        if not monitor.can_go_on_without(getattr(error, "rank", None)):
            raise error  # the store's host, or a failure nobody can name: today's clear error
        leave_group()  # a survivor still blocked in a collective with this one fails now
        self.generation += 1
        membership = agree(
            store, self.generation, me, self.members, report,
            gone=monitor.gone, timeout=self.options.dead_after_seconds + self.timeout,
        )  # fmt: skip
        lost = sorted(set(self.members) - set(membership.members))
        monitor.continue_without(lost)
        regroup(membership.members, self.generation)
        self.members = membership.members
        self.rounds.append(time.monotonic() - start)
        if me == membership.members[0]:
            log.warning(
                "stratagem: replica%s %s lost (%s); training goes on with %d replica%s",
                "s" if len(lost) > 1 else "", ", ".join(map(str, lost)) or "none",
                _first_line(error), len(membership.members), "s" if len(membership.members) > 1 else "",
            )  # fmt: skip
        return membership

    # --- a replica that comes back ---------------------------------------------------------------
    @property
    def coming_back(self) -> bool:
        """Whether this process is new in a running job, not let in yet."""
        return coming_back()

    def joins_waiting(self) -> bool:
        """Whether a lost rank asked to come back (asked of the store by the leader only: the
        others say no, and the step's sync tells everyone what the leader saw)."""
        me, store = launch_rank(), joined_store()
        absent = self._absent()
        if not absent or me != self.members[0] or store is None:
            return False
        return bool(joins_pending(store, absent))

    def _absent(self) -> list[int]:
        """The ranks the job started with that are not members now."""
        return [r for r in range(self.world) if r not in self.members]

    def let_in(self) -> None:
        """Every member, at the step boundary where the leader saw a request: the new membership
        with those who asked, the process group formed again over it."""
        me, store, monitor = launch_rank(), joined_store(), failure_monitor()
        assert me is not None and store is not None and monitor is not None
        self.generation += 1
        if me == self.members[0]:
            membership = admit(store, self.generation, self.members, joins_pending(store, self._absent()))
        else:
            membership = admitted(store, self.generation, self.timeout)
        came = sorted(set(membership.members) - set(self.members))
        monitor.admit(came)
        regroup(membership.members, self.generation)
        self.members = membership.members
        if me == membership.members[0]:
            log.warning("stratagem: replica%s %s came back; training goes on with %d replicas",
                        "s" if len(came) > 1 else "", ", ".join(map(str, came)), len(membership.members))  # fmt: skip

    def open(self) -> None:
        """fit begins: the leader lets lost replicas that come back in (until ``close``)."""
        store = joined_store()
        if store is not None and launch_rank() == self.members[0]:
            reopen(store)

    def close(self) -> None:
        """fit ended: the leader tells a replica still waiting to come back that it is too late."""
        store = joined_store()
        if store is not None and launch_rank() == self.members[0]:
            with contextlib.suppress(Exception):
                close(store)

    def come_back(self) -> Membership:
        """This new process asks to be let in and waits (at most ``max(600, 5 x timeout)`` s)
        until the members let it in at a step boundary; the process group then includes it."""
        me, store, monitor = launch_rank(), joined_store(), failure_monitor()
        assert me is not None and store is not None and monitor is not None
        request_join(store, me)
        try:
            membership = wait_admitted(store, me, max(600.0, 5 * self.timeout))
        except TrainingEndedError as e:  # a defined end: nothing to do, nothing failed
            sys.stderr.write(f"stratagem: {e}; it ends\n")
            sys.stderr.flush()
            raise SystemExit(0) from None
        self.generation, self.members = membership.generation, membership.members
        monitor.continue_without(self._absent())
        let_in(membership.members, membership.generation)
        return membership


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
