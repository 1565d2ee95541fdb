"""Pipeline schedules as data: per stage, the ordered forward/backward actions (GPipe, 1F1B,
zero-bubble, interleaved 1F1B).

A schedule is a pure value: ``gpipe(2, 4)`` prints as::

    stage 0: F0 F1 F2 F3 B3 B2 B1 B0
    stage 1: F0 F1 F2 F3 B3 B2 B1 B0

``simulate`` plays it on an ideal clock (one action per stage per tick, an action waits for the
neighbour it needs), which proves it free of deadlock and shows its bubble.

Zero-bubble plans split the backward of a micro-batch in two: ``I`` (the gradient of the stage's
input, which the previous stage waits for) and ``W`` (the gradients of the weights, which nobody
waits for, so it can fill the bubble).

Interleaved plans cut the model into ``K x v`` chunks, rank ``r`` holding chunks ``r, r + K, ...``
(looping placement); their actions name the chunk and print as torch's do: ``2F0`` is the
forward of micro-batch 0 on chunk 2. The other plans' actions run on the rank's only chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class Action(NamedTuple):
    """Forward (``"F"``) or backward (``"B"``) of one micro-batch; prints as ``F0``/``B3``. A
    split backward is ``"I"`` (input gradient, sent on) then ``"W"`` (weight gradients).
    ``chunk``: the model chunk it runs on (interleaved plans; prints as ``2F0``), None: the
    rank's only chunk."""

    kind: str
    microbatch: int
    chunk: int | None = None

    def __str__(self) -> str:
        head = "" if self.chunk is None else str(self.chunk)
        return f"{head}{self.kind}{self.microbatch}"


def F(i: int, chunk: int | None = None) -> Action:  # noqa: N802 - reads like the printed form
    return Action("F", i, chunk)


def B(i: int, chunk: int | None = None) -> Action:  # noqa: N802
    return Action("B", i, chunk)


def I(i: int, chunk: int | None = None) -> Action:  # noqa: N802, E743
    return Action("I", i, chunk)


def W(i: int, chunk: int | None = None) -> Action:  # noqa: N802
    return Action("W", i, chunk)

#: the actions that send the gradient of the stage's input to the previous stage
BACKWARD_KINDS = ("B", "I")


@dataclass(frozen=True)
class Schedule:
    """The actions of every stage (rank), in the order each carries them out; with
    ``virtual_stages`` v > 1, rank ``r`` holds chunks ``r, r + K, ..., r + (v - 1) K``."""

    name: str
    num_stages: int
    num_microbatches: int
    stages: tuple[tuple[Action, ...], ...]
    virtual_stages: int = 1

    def __getitem__(self, stage: int) -> tuple[Action, ...]:
        return self.stages[stage]

    @property
    def num_chunks(self) -> int:
        return self.num_stages * self.virtual_stages

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunks ``rank`` holds, in model order (looping placement)."""
        return tuple(rank + j * self.num_stages for j in range(self.virtual_stages))

    def chunk_of(self, action: Action, rank: int) -> int:
        """The chunk ``action`` of ``rank``'s plan runs on."""
        return rank if action.chunk is None else action.chunk

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


def zero_bubble(num_stages: int, num_microbatches: int) -> Schedule:
    """Zero-bubble (ZB-H1, Qi et al. 2023): 1F1B's memory, the backward split into ``I`` (input
    gradient) and ``W`` (weight gradients), the ``W`` passes filling the bubble.

    Built by a greedy list scheduler on the simulator's clock (unit costs): each tick a stage runs
    a ready ``I`` if it has one, else the next ``F`` while fewer than ``min(K, K - s + 1)``
    micro-batches hold activations on it (forwarded, weight gradients not yet taken), else its
    oldest pending ``W``. Stage 0 holds at most K micro-batches, as under 1F1B; a later stage one
    more than under 1F1B (never more than stage 0), which lets its ``W`` passes wait for the
    bubble. On the unit clock the bubble is 2K - 3 or 2K - 2 ticks beside 3M of work (1F1B:
    3(K - 1), its B taking 2 ticks).
    """
    _check_sizes(num_stages, num_microbatches)
    k, m = num_stages, num_microbatches
    acts: list[list[Action]] = [[] for _ in range(k)]
    f_done: list[set[int]] = [set() for _ in range(k)]
    i_done: list[set[int]] = [set() for _ in range(k)]
    w_done = [0] * k
    next_f = [0] * k
    pending_w: list[list[int]] = [[] for _ in range(k)]
    while any(len(a) < 3 * m for a in acts):
        row: list[Action | None] = []
        for s in range(k):
            ready_i = sorted(
                i for i in f_done[s] - i_done[s] if (i in i_done[s + 1] if s < k - 1 else True)
            )
            in_flight = next_f[s] - w_done[s]
            f_ready = next_f[s] < m and (s == 0 or next_f[s] in f_done[s - 1])
            if ready_i:
                row.append(I(ready_i[0]))
            elif f_ready and in_flight < min(k, k - s + 1):
                row.append(F(next_f[s]))
            elif pending_w[s]:
                row.append(W(pending_w[s][0]))
            else:
                row.append(None)
        if all(a is None for a in row):  # pragma: no cover - the rules above always progress
            raise AssertionError(f"zero_bubble({k}, {m}) stalled")
        for s, a in enumerate(row):
            if a is None:
                continue
            acts[s].append(a)
            if a.kind == "F":
                f_done[s].add(a.microbatch)
                next_f[s] += 1
            elif a.kind == "I":
                i_done[s].add(a.microbatch)
                pending_w[s].append(a.microbatch)
            else:
                pending_w[s].pop(0)
                w_done[s] += 1
    return Schedule("zero_bubble", k, m, tuple(tuple(a) for a in acts))


def interleaved_rounds(num_stages: int, num_microbatches: int, name: str = "interleaved_1f1b") -> tuple[int, int]:
    """Interleaved plans run micro-batches in rounds (torch's flexible rule): the number of rounds
    ``max(1, M // K)`` and the micro-batches per round; M must be a multiple of the rounds."""
    rounds = max(1, num_microbatches // num_stages)
    if num_microbatches % rounds:
        raise ValueError(
            f"{name} with virtual stages runs the micro-batches in max(1, M // K) = {rounds} rounds of equal "
            f"size, but num_microbatches={num_microbatches} is not a multiple of {rounds} "
            f"(num_stages={num_stages}); use a multiple of num_stages (e.g. "
            f"{rounds * num_stages}) or at most num_stages micro-batches"
        )
    return rounds, num_microbatches // rounds


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021), as torch's
    ``ScheduleInterleaved1F1B`` orders it: ``v`` chunks per rank (looping placement), forwards
    taken a round of micro-batches per chunk in turn, backwards in the reverse chunk order; a rank
    warms up with ``(v - 1) x per_round + 2 (K - 1 - r)`` forwards, then alternates F and B. The
    bubble shrinks by ``v`` against 1F1B; each rank sends ``v`` times as many messages.
    """
    return _interleaved("interleaved_1f1b", num_stages, num_microbatches, virtual_stages, split=False)


def interleaved_zero_bubble(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved zero-bubble, as torch's ``ScheduleInterleavedZeroBubble`` orders it: the
    interleaved plan with ``(v - 1) x per_round + (K - 1 - r)`` warm-up forwards and the backward
    split into ``I`` and ``W``; rank r defers its ``W`` passes by r steps, then runs one after each
    ``I``, the rest at the end. ``zero_bubble`` with ``virtual_stages`` > 1 is this plan."""
    return _interleaved("zero_bubble", num_stages, num_microbatches, virtual_stages, split=True)


def _interleaved(name: str, k: int, m: int, v: int, *, split: bool) -> Schedule:
    _check_sizes(k, m)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages must be an integer >= 1, got {v!r}")
    _, per_round = interleaved_rounds(k, m, name)
    back = I if split else B
    stages = []
    for r in range(k):
        total = m * v
        warmup = min((v - 1) * per_round + (1 if split else 2) * (k - 1 - r), total)

        def fwd_chunk(step: int, r: int = r) -> int:
            return (step // per_round) % v * k + r

        def bwd_chunk(step: int, r: int = r, warmup: int = warmup) -> int:
            return (v - 1 - ((step - warmup) // per_round) % v) * k + r

        counters: dict[tuple[str, int], int] = {}

        def act(kind: Callable[[int, int | None], Action], c: int, counters: dict[tuple[str, int], int] = counters) -> Action:
            """The next micro-batch of ``kind`` on chunk ``c``."""
            a = kind(0, c)
            n = counters.get((a.kind, c), 0)
            counters[a.kind, c] = n + 1
            return kind(n, c)

        acts: list[Action] = []
        backward_ops: list[int] = []
        weights = 0
        for op in range(total + warmup):  # warm-up forwards, F/B pairs, cool-down backwards
            if op < total:
                acts.append(act(F, fwd_chunk(op)))
            if op >= warmup:
                acts.append(act(back, bwd_chunk(op)))
                backward_ops.append(op)
                if split and op - warmup >= r:  # rank r holds r W passes back
                    acts.append(act(W, bwd_chunk(backward_ops[weights])))
                    weights += 1
        while split and weights < len(backward_ops):
            acts.append(act(W, bwd_chunk(backward_ops[weights])))
            weights += 1
        stages.append(tuple(acts))
    return Schedule(name, k, m, tuple(stages), v)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zero_bubble": zero_bubble,
    "interleaved_1f1b": interleaved_1f1b,
}

#: the schedules that hold several chunks per rank (``virtual_stages``, default 2)
INTERLEAVED = ("interleaved_1f1b",)
#: the schedules that may (``virtual_stages`` > 1; default 1)
MAY_INTERLEAVE = ("interleaved_1f1b", "zero_bubble")


def make_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule called ``name`` (one of ``SCHEDULES``), checked."""
    key = schedule_key(name)
    if key is None:
        raise ValueError(f"unknown schedule {name!r}; use one of {sorted(SCHEDULES)}")
    if key in INTERLEAVED:
        plan = SCHEDULES[key](num_stages, num_microbatches, virtual_stages)
    elif key == "zero_bubble" and virtual_stages != 1:
        plan = interleaved_zero_bubble(num_stages, num_microbatches, virtual_stages)
    elif virtual_stages != 1:
        raise ValueError(
            f"schedule {key!r} holds one chunk per stage, got virtual_stages={virtual_stages}; "
            f"use schedule='interleaved_1f1b' or 'zero_bubble' for several chunks per stage"
        )
    else:
        plan = SCHEDULES[key](num_stages, num_microbatches)
    check(plan)
    return plan


def schedule_key(name: object) -> str | None:
    """The ``SCHEDULES`` key ``name`` spells (case, ``-`` and ``_`` aside), or None."""
    if not isinstance(name, str):
        return None
    norm = {k.replace("_", ""): k for k in SCHEDULES}
    return norm.get(name.lower().replace("-", "").replace("_", ""))


def forward_only(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Inference: the forwards of every micro-batch, in order (chunk by chunk)."""
    _check_sizes(num_stages, num_microbatches)
    k, m, v = num_stages, num_microbatches, virtual_stages
    if v == 1:
        acts = tuple(F(i) for i in range(m))
        return Schedule("forward", k, m, tuple(acts for _ in range(k)))
    stages = tuple(tuple(F(i, r + j * k) for j in range(v) for i in range(m)) for r in range(k))
    return Schedule("forward", k, m, stages, v)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"a schedule needs num_stages >= 1 and num_microbatches >= 1; got "
            f"num_stages={num_stages}, num_microbatches={num_microbatches}"
        )


def _by_chunk(plan: Schedule) -> list[list[Action]]:
    """Each chunk's actions in the order its rank runs them."""
    out: list[list[Action]] = [[] for _ in range(plan.num_chunks)]
    for r, acts in enumerate(plan.stages):
        for a in acts:
            c = plan.chunk_of(a, r)
            if not 0 <= c < plan.num_chunks or c % plan.num_stages != r:
                raise ValueError(f"stage {r} of {plan.name} runs {a} on chunk {c}, which it does not hold")
            out[c].append(a)
    return out


def check(plan: Schedule) -> None:
    """Raise ValueError unless every chunk runs F(i) once, then B(i) once (if any B) -- or I(i)
    then W(i) once each -- for every micro-batch, and neighbouring chunks send and receive in the
    same order."""
    f_orders, b_orders = [], []
    every = list(range(plan.num_microbatches))
    for s, acts in enumerate(_by_chunk(plan)):
        kinds = {a.kind for a in acts}
        if not kinds <= {"F", "B", "I", "W"} or ("B" in kinds and kinds & {"I", "W"}):
            raise ValueError(f"stage {s} of {plan.name} mixes or misnames actions: {sorted(kinds)}")
        fs = [a.microbatch for a in acts if a.kind == "F"]
        bs = [a.microbatch for a in acts if a.kind in BACKWARD_KINDS]
        ws = [a.microbatch for a in acts if a.kind == "W"]
        if sorted(fs) != every or (bs and sorted(bs) != every) or ("I" in kinds and sorted(ws) != every):
            raise ValueError(f"stage {s} of {plan.name} does not run each micro-batch once: {acts}")
        done: set[int] = set()
        inputs_done: set[int] = set()
        for a in acts:
            if a.kind == "F":
                done.add(a.microbatch)
            elif a.microbatch not in done:
                raise ValueError(f"stage {s} of {plan.name} runs {a} before F{a.microbatch}")
            elif a.kind == "I":
                inputs_done.add(a.microbatch)
            elif a.kind == "W" and a.microbatch not in inputs_done:
                raise ValueError(f"stage {s} of {plan.name} runs {a} before I{a.microbatch}")
        f_orders.append(fs)
        b_orders.append(bs)
    for s in range(1, plan.num_chunks):
        if f_orders[s] != f_orders[s - 1] or b_orders[s] != b_orders[s - 1]:
            raise ValueError(
                f"stages {s - 1} and {s} of {plan.name} run micro-batches in different orders "
                "(their messages would be matched wrongly)"
            )


def simulate(plan: Schedule) -> list[tuple[Action | None, ...]]:
    """Play ``plan`` on an ideal clock: per tick, the action each stage (rank) runs (None: idle).

    F(i) on chunk c waits for F(i) on chunk c-1; B(i) (or I(i)) waits for B(i) (or I(i)) on chunk
    c+1; W(i) waits for nothing but its own chunk's I(i) before it. Raises ValueError if the plan
    deadlocks.
    """
    k, last = plan.num_stages, plan.num_chunks - 1
    pos = [0] * k
    done: set[tuple[int, str, int]] = set()
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
            c = plan.chunk_of(a, s)
            if a.kind == "F":
                ready = c == 0 or (c - 1, "F", a.microbatch) in done
            elif a.kind == "W":
                ready = True
            else:
                ready = c == last or (c + 1, a.kind, a.microbatch) in done
            row.append(a if ready else None)
        if all(a is None for a in row):
            waiting = ", ".join(
                f"stage {s} at {plan.stages[s][pos[s]]}" for s in range(k) if pos[s] < len(plan.stages[s])
            )
            raise ValueError(f"schedule {plan.name} deadlocks: {waiting}")
        for s, act in enumerate(row):
            if act is not None:
                done.add((plan.chunk_of(act, s), act.kind, act.microbatch))
                pos[s] += 1
        ticks.append(tuple(row))
    return ticks
