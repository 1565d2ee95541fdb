"""fit's side of ``FailureOptions(on_failure="continue")``: a lost replica costs one update's retry.

Every replica reads the whole global batches (``inputs.GlobalBatches(whole=True)``) and computes
its range of the batch's pieces under the current membership (``pieces.step_global``), so the
survivors can take over a lost replica's share of the same global batch. An update is committed
once its gradient is whole on every replica and the metric totals are summed (``commit``), before
the optimizer steps: what is committed is recorded (the position in the data, the counters, the
metric totals). After a failed collective, ``distribute.failover.Survivors`` forms the job again
over the survivors; here their states are made equal: survivors that committed the same number
of updates have the same state (the common case: nothing moves), and otherwise the one that got
furthest (they are at most one update apart: an update needs every replica) sends its model,
optimizer, scheduler and record to the others. Then the metrics restart from the committed totals
(held by the new rank 0) and the interrupted update is trained again on the same global batch.
With ``enable_op_determinism`` the pieces and their sum do not depend on who computes them, so
the weights are bit for bit those of the run in which nothing failed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stratagem.comm.errors import CollectiveError
from stratagem.distribute.failover import Survivors
from stratagem.distribute.strategy import Strategy
from stratagem.train.metrics import Metric

#: what failures cost in this process, one record per event, for benchmarks/failover.py:
#: {"event": "lost", "round_s": agreeing and regrouping, "lost_s": from the interrupted step's
#: start to the retried step's commit}, {"event": "rejoin", "bytes": sent, "seconds": taken}
FIGURES: list[dict[str, Any]] = []


@dataclasses.dataclass
class Committed:
    """Where the last committed update left fit: the data position, the counters, the totals."""

    epoch: int = 0
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    step: int = 0
    iterations: int = 0
    updates: int = 0
    totals: list[list[float]] = dataclasses.field(default_factory=list)


class FitFailover:
    """What fit does after a lost replica (see the module's docstring)."""

    def __init__(self, strategy: Strategy, steps: Any, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        ext = strategy.extended
        self.strategy, self.steps, self.optimizer, self.scheduler = strategy, steps, optimizer, scheduler
        self.survivors = Survivors(ext.world.world_size, ext.failure)  # type: ignore[attr-defined]
        self.committed = Committed()
        self._lost_since: float | None = None
        #: facts agreed once (name: (get, put)), kept alike through a reform (``keep_agreed``)
        self._facts: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        pieces = getattr(steps, "pieces", None)
        if pieces is not None:  # the pieces' seed, the chief's, broadcast at the first step
            self.keep_agreed("seed", lambda: pieces.base_seed, pieces.adopt_base_seed)

    def keep_agreed(self, name: str, get: Callable[[], Any], put: Callable[[Any], None]) -> None:
        """A fact the replicas agree on once, by a collective a failure can leave done on some
        survivors and not on others (the pieces' seed, the callbacks' facts): its holder would go
        on past it while the others make it again, and the survivors would wait in different
        collectives. ``get()`` is this process's (JSON-able; None: not agreed yet); each survivor
        reports its own in the round, and after it every survivor is ``put`` the first member's
        that has one, so all go on alike."""
        self._facts[name] = (get, put)

    def interrupted(self, step_began: float) -> None:
        """The step that began at ``step_began`` (``time.perf_counter``) failed: the cost of the
        failure is counted until the next commit."""
        self._lost_since = step_began

    def record(self, epoch: int, data: dict[str, Any], step: int, iterations: int, tracked: Sequence[Metric],
               *, committing: bool = False) -> None:  # fmt: skip
        """An update committed (``committing``: called from its commit, before the pieces count
        it) or an epoch begun, with its zero totals: remember where fit is. The updates recorded
        are those done with this one: an epoch's start and its first commit must never report the
        same count, or survivors one update apart would take themselves for level."""
        since = self._lost_since
        if since is not None:
            self._lost_since = None
            FIGURES.append({"event": "lost", "round_s": self.survivors.rounds[-1],
                            "lost_s": time.perf_counter() - since})  # fmt: skip
        self.committed = Committed(
            epoch, dict(data), step, iterations, int(self.steps.pieces.updates) + int(committing),
            [m.global_totals().tolist() for m in tracked],
        )  # fmt: skip

    def recover(self, error: CollectiveError, tracked: Sequence[Metric]) -> Committed:
        """After ``error``: the job formed again over the survivors, every survivor at the same
        committed state; returns it (the caller puts its data and counters there)."""
        mine = self.committed
        facts = {name: get() for name, (get, _) in self._facts.items()}
        membership = self.survivors.go_on(error, {"updates": mine.updates, "facts": facts})
        for name, (_, put) in self._facts.items():
            known = [membership.reports[m].get("facts", {}).get(name) for m in sorted(membership.reports)]
            value = next((v for v in known if v is not None), None)
            if value is not None:
                put(value)
        updates = {m: int(r["updates"]) for m, r in membership.reports.items()}
        best = max(updates.values())
        if any(u != best for u in updates.values()):
            source = membership.rank_of(min(m for m, u in updates.items() if u == best))
            comm = self.strategy.extended.world
            self._share(source, take=comm.rank != source)
        self._restart_totals(tracked)
        return self.committed

    def _restart_totals(self, tracked: Sequence[Metric]) -> None:
        """The committed totals, held once (by rank 0: later sums add to them), as every metric's
        global totals."""
        rank = self.strategy.extended.world.rank
        for m, totals in zip(tracked, self.committed.totals):
            t = torch.tensor(totals, dtype=torch.float64)
            m.load_totals(t if rank == 0 else torch.zeros_like(t))
            m.set_global_totals(t)

    # --- a replica that comes back ---------------------------------------------------------------
    def open(self) -> None:
        self.survivors.open()

    def close(self) -> None:
        self.survivors.close()

    @property
    def joining(self) -> bool:
        """Whether this process is new in a running job (it takes fit's state from a live peer)."""
        return self.survivors.coming_back

    def joins_waiting(self) -> bool:
        """Whether a lost replica asked to come back (the leader's look; summed in the step's sync)."""
        return self.survivors.joins_waiting()

    def let_in(self, loop: Any) -> None:
        """The members, at a step boundary: the replicas that asked are let in and get the
        training state from rank 0 (whose state every member has)."""
        self.survivors.let_in()
        self._share(0, take=False, loop=loop)

    def enter(self, loop: Any) -> None:
        """A new process in a running job: ask to be let in, then take the training state and
        the position (epoch, step, data, history) from rank 0; fit goes on from there."""
        self.survivors.come_back()
        self.strategy.extended.rejoined()  # type: ignore[attr-defined]
        self._share(0, take=True, loop=loop)

    def _share(self, src: int, *, take: bool, loop: Any = None) -> None:
        """Replica ``src``'s model, optimizer, scheduler, record and pieces' counters (and, with
        ``loop``, fit's position: epoch, step, data, history, counters) sent to every member;
        those that ``take`` it put it in place, the others have the same already. Every member
        then plans its gradient buckets again at the next reducing pass, together."""
        from stratagem.train.resume import FitProgress

        comm = self.strategy.extended.world
        pieces = self.steps.pieces
        state = None
        if comm.rank == src:
            state = {
                "model": {k: v.detach() for k, v in self.steps.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "committed": dataclasses.asdict(self.committed),
                "pieces": (pieces.updates, pieces._base),
                # what the members agreed once (a process let in agrees none of it again alone)
                "facts": {name: get() for name, (get, _) in self._facts.items()},
            }
            if loop is not None:
                progress = FitProgress()
                loop.capture(progress, epoch_end=False)
                state["progress"] = progress.state
        began = time.perf_counter()
        state, nbytes = _broadcast_state(comm, state, src)
        self.strategy.extended.members_changed()  # type: ignore[attr-defined]
        if comm.rank == src and loop is not None:
            FIGURES.append({"event": "rejoin", "seconds": time.perf_counter() - began, "bytes": nbytes})
        if not take:
            return
        with torch.no_grad():
            self.steps.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.committed = Committed(**state["committed"])
        if loop is not None:
            progress = FitProgress()
            progress.state = state["progress"]
            loop.batches.dist._checked = True  # the others compared their first batches long ago
            loop.restore(progress)
            self._restart_totals(loop.tracked)  # rank 0 holds the epoch's totals
        pieces.updates, pieces._base = state["pieces"]
        for name, value in state["facts"].items():
            if value is not None and name in self._facts:
                self._facts[name][1](value)


def _broadcast_state(comm: Any, state: Any, src: int) -> tuple[Any, int]:
    """``src``'s ``state`` (nested dicts, lists and tuples of tensors and plain values) on every
    member: its structure and plain values in one object broadcast (each tensor a ``(shape,
    dtype)`` slot), its tensors in one flat broadcast per dtype (no pickling of the bytes).
    Returns it and the tensors' bytes."""
    tensors: list[torch.Tensor] = []

    def hollow(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v.detach())
            return _Slot(len(tensors) - 1, tuple(v.shape), v.dtype)
        if isinstance(v, dict):
            return type(v)((k, hollow(x)) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return type(v)(hollow(x) for x in v)
        return v

    shape = comm.broadcast_object(hollow(state) if comm.rank == src else None, src)
    if comm.rank != src:
        slots: list[_Slot] = []

        def find(v: Any) -> None:
            if isinstance(v, _Slot):
                slots.append(v)
            elif isinstance(v, dict):
                for x in v.values():
                    find(x)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    find(x)

        find(shape)
        tensors = [torch.empty(0)] * len(slots)
        for slot in slots:
            tensors[slot.index] = torch.empty(slot.shape, dtype=slot.dtype)
    comm.broadcast_tensors_(tensors, src)

    def fill(v: Any) -> Any:
        if isinstance(v, _Slot):
            return tensors[v.index]
        if isinstance(v, dict):
            return type(v)((k, fill(x)) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return type(v)(fill(x) for x in v)
        return v

    return (state if comm.rank == src else fill(shape)), sum(t.numel() * t.element_size() for t in tensors)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor goes in a state sent by ``_broadcast_state``."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
