"""Pipeline schedules as data: per stage, the ordered forward/backward actions (GPipe, 1F1B).

A schedule is a pure value: ``gpipe(2, 4)`` prints as::

    stage 0: F0 F1 F2 F3 B3 B2 B1 B0
    stage 1: F0 F1 F2 F3 B3 B2 B1 B0

``simulate`` plays it on an ideal clock (one action per stage per tick, an action waits for the
neighbour it needs), which proves it free of deadlock and shows its bubble.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class Action(NamedTuple):
    """Forward (``"F"``) or backward (``"B"``) of one micro-batch; prints as ``F0``/``B3``."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def F(i: int) -> Action:  # noqa: N802 - reads like the printed form
    return Action("F", i)


def B(i: int) -> Action:  # noqa: N802
    return Action("B", i)


@dataclass(frozen=True)
class Schedule:
    """The actions of every stage, in the order each stage carries them out."""

    name: str
    num_stages: int
    num_microbatches: int
    stages: tuple[tuple[Action, ...], ...]

    def __getitem__(self, stage: int) -> tuple[Action, ...]:
        return self.stages[stage]

    def __str__(self) -> str:
        return "\n".join(
            f"stage {s}: " + " ".join(str(a) for a in acts) for s, acts in enumerate(self.stages)
        )

    def timeline(self) -> str:
        """The simulated clock as a table: one row per stage, one column per tick."""
        ticks = simulate(self)
        width = max(len(str(a)) for tick in ticks for a in tick if a is not None)
        rows = []
        for s in range(self.num_stages):
            cells = [(str(t[s]) if t[s] is not None else "").ljust(width) for t in ticks]
            rows.append(f"stage {s}: " + " ".join(cells).rstrip())
        return "\n".join(rows)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward in reverse micro-batch order."""
    _check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    acts = tuple([F(i) for i in range(m)] + [B(i) for i in reversed(range(m))])
    return Schedule("gpipe", num_stages, m, tuple(acts for _ in range(num_stages)))


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm up with K-s-1 forwards, then alternate F and B, then drain.

    At most K micro-batches are in flight on a stage instead of M, with GPipe's bubble.
    """
    _check_sizes(num_stages, num_microbatches)
    k, m = num_stages, num_microbatches
    stages = []
    for s in range(k):
        warmup = min(k - s - 1, m)
        acts = [F(i) for i in range(warmup)]
        for j in range(m - warmup):
            acts += [F(warmup + j), B(j)]
        acts += [B(i) for i in range(m - warmup, m)]
        stages.append(tuple(acts))
    return Schedule("1f1b", k, m, tuple(stages))


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The schedule called ``name`` (one of ``SCHEDULES``), checked."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; use one of {sorted(SCHEDULES)}")
    plan = SCHEDULES[key](num_stages, num_microbatches)
    check(plan)
    return plan


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Inference: the forwards of every micro-batch, in order."""
    _check_sizes(num_stages, num_microbatches)
    acts = tuple(F(i) for i in range(num_microbatches))
    return Schedule("forward", num_stages, num_microbatches, tuple(acts for _ in range(num_stages)))


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"a schedule needs num_stages >= 1 and num_microbatches >= 1; got "
            f"num_stages={num_stages}, num_microbatches={num_microbatches}"
        )


def check(plan: Schedule) -> None:
    """Raise ValueError unless every stage runs F(i) once, then B(i) once (if any B), for every
    micro-batch, and neighbouring stages send and receive in the same order."""
    f_orders, b_orders = [], []
    for s, acts in enumerate(plan.stages):
        fs = [a.microbatch for a in acts if a.kind == "F"]
        bs = [a.microbatch for a in acts if a.kind == "B"]
        if sorted(fs) != list(range(plan.num_microbatches)) or (
            bs and sorted(bs) != list(range(plan.num_microbatches))
        ):
            raise ValueError(f"stage {s} of {plan.name} does not run each micro-batch once: {acts}")
        done: set[int] = set()
        for a in acts:
            if a.kind == "F":
                done.add(a.microbatch)
            elif a.microbatch not in done:
                raise ValueError(f"stage {s} of {plan.name} runs {a} before F{a.microbatch}")
        f_orders.append(fs)
        b_orders.append(bs)
    for s in range(1, plan.num_stages):
        if f_orders[s] != f_orders[s - 1] or b_orders[s] != b_orders[s - 1]:
            raise ValueError(
                f"stages {s - 1} and {s} of {plan.name} run micro-batches in different orders "
                "(their messages would be matched wrongly)"
            )


def simulate(plan: Schedule) -> list[tuple[Action | None, ...]]:
    """Play ``plan`` on an ideal clock: per tick, the action each stage runs (None: idle).

    F(i) on stage s waits for F(i) on s-1; B(i) waits for B(i) on s+1. Raises ValueError if the
    plan deadlocks.
    """
    k = plan.num_stages
    pos = [0] * k
    done: set[tuple[int, Action]] = set()
    ticks: list[tuple[Action | None, ...]] = []
    total = sum(len(a) for a in plan.stages)
    while sum(pos) < total:
        row: list[Action | None] = []
        for s in range(k):
            acts = plan.stages[s]
            if pos[s] >= len(acts):
                row.append(None)
                continue
            a = acts[pos[s]]
            if a.kind == "F":
                ready = s == 0 or (s - 1, a) in done
            else:
                ready = s == k - 1 or (s + 1, a) in done
            row.append(a if ready else None)
        if all(a is None for a in row):
            waiting = ", ".join(
                f"stage {s} at {plan.stages[s][pos[s]]}" for s in range(k) if pos[s] < len(plan.stages[s])
            )
            raise ValueError(f"schedule {plan.name} deadlocks: {waiting}")
        for s, act in enumerate(row):
            if act is not None:
                done.add((s, act))
                pos[s] += 1
        ticks.append(tuple(row))
    return ticks
