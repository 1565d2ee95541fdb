"""A pipeline timeline: what each stage did when (its F/B/I/W actions and the time it waited for
a neighbour inside them), the measured bubble against the bound, a Chrome trace and a picture.

``Recorder`` is the runtime's side (one per stage, appended to while profiling); ``Timeline``
holds every stage's events of the profiled steps (gathered by the strategy) and is pure data.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

#: block colours of the picture (and the trace's categories)
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
WAIT_COLOUR = "#D0D0D0"


class Event(NamedTuple):
    """One action of one stage: ``start``/``end`` in seconds (wall clock), ``wait`` the seconds it
    spent blocked in a receive from a neighbour (from ``start``)."""

    step: int
    kind: str
    microbatch: int
    start: float
    end: float
    wait: float = 0.0
    chunk: int | None = None  # interleaved plans: the model chunk the action ran on

    @property
    def label(self) -> str:
        """As the plan prints the action: ``F3``, or ``2F3`` on chunk 2."""
        return f"{'' if self.chunk is None else self.chunk}{self.kind}{self.microbatch}"

    @property
    def busy(self) -> float:
        return self.end - self.start - self.wait


class Recorder:
    """The events of one stage while profiling (the runtime calls ``begin_step`` then ``add``)."""

    clock = staticmethod(time.time)  # comparable across processes (and hosts, as far as NTP goes)

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.step = -1

    def begin_step(self) -> None:
        self.step += 1

    def add(self, kind: str, microbatch: int, start: float, end: float, wait: float, chunk: int | None = None) -> None:
        self.events.append(Event(self.step, kind, microbatch, start, end, wait, chunk))


@dataclass
class Timeline:
    """Every stage's events (``stages[s]``) over the profiled steps of a K-stage, M-micro-batch
    pipeline running ``schedule``. Filled when ``strategy.profile()`` exits."""

    schedule: str = ""
    num_stages: int = 0
    num_microbatches: int = 0
    stages: list[list[Event]] = field(default_factory=list)
    trace_path: Path | None = None
    png_path: Path | None = None

    @property
    def steps(self) -> list[int]:
        return sorted({e.step for events in self.stages for e in events})

    @property
    def bound(self) -> float:
        """GPipe's bubble fraction (K - 1) / (M + K - 1)."""
        k, m = self.num_stages, self.num_microbatches
        return (k - 1) / (m + k - 1)

    def step_bubble(self, step: int) -> float:
        """The idle share of ``step``: 1 - (time the stages computed) / (K x the step's span from
        the first action's start to the last action's end); waits inside actions are idle."""
        events = [e for s in self.stages for e in s if e.step == step]
        if not events:
            raise ValueError(f"step {step} was not profiled (profiled: {self.steps})")
        span = max(e.end for e in events) - min(e.start for e in events)
        busy = sum(e.busy for e in events)
        return 1.0 - busy / (self.num_stages * span) if span > 0 else 0.0

    @property
    def bubble(self) -> float:
        """The measured bubble fraction: the median over the profiled steps."""
        values = sorted(self.step_bubble(s) for s in self.steps)
        if not values:
            raise ValueError("no step was profiled: run strategy.run(pipe.train_step, ...) inside strategy.profile()")
        return values[len(values) // 2]

    def summary(self) -> str:
        k, m, n = self.num_stages, self.num_microbatches, len(self.steps)
        return (
            f"{self.schedule}, {k} stages, {m} micro-batches, {n} step{'s' if n != 1 else ''}: bubble "
            f"{self.bubble:.1%} measured, (K-1)/(M+K-1) = {self.bound:.1%}"
        )

    # --- Chrome trace -----------------------------------------------------------------------------
    def chrome_trace(self) -> dict[str, Any]:
        """The events in the Trace Event Format (chrome://tracing, ui.perfetto.dev): one thread
        per stage, one complete event per action, the wait inside it as a nested event."""
        t0 = min((e.start for s in self.stages for e in s), default=0.0)
        us = lambda t: round((t - t0) * 1e6, 3)  # noqa: E731
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": f"pipeline ({self.schedule})"}}
        ]
        for s, events in enumerate(self.stages):
            out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": s, "args": {"sort_index": s}})
            for e in events:
                args = {"step": e.step, "microbatch": e.microbatch, "wait_us": round(e.wait * 1e6, 3)}
                if e.chunk is not None:
                    args["chunk"] = e.chunk
                out.append({"name": e.label, "cat": e.kind, "ph": "X", "pid": 0, "tid": s,
                            "ts": us(e.start), "dur": us(e.end) - us(e.start), "args": args})  # fmt: skip
                if e.wait > 0:
                    out.append({"name": "wait", "cat": "wait", "ph": "X", "pid": 0, "tid": s,
                                "ts": us(e.start), "dur": round(e.wait * 1e6, 3), "args": args})  # fmt: skip
        meta = {"schedule": self.schedule, "num_stages": self.num_stages,
                "num_microbatches": self.num_microbatches, "bubble": self.bubble, "bound": self.bound}  # fmt: skip
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta}

    def write_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_trace()))
        return path

    # --- picture ----------------------------------------------------------------------------------
    def plot(self, path: str | Path, *, steps: Sequence[int] | None = None) -> Path:
        """A PNG: stages as rows, time across, actions as coloured blocks (their waits grey), the
        gaps are the bubble. Needs matplotlib."""
        try:
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as missing:
            raise ImportError(
                "the pipeline timeline picture needs matplotlib, which is not installed; install it "
                "with `pip install matplotlib` (or `pip install stratagem[plot]`)"
            ) from missing
        chosen = set(self.steps if steps is None else steps)
        events = [[e for e in s if e.step in chosen] for s in self.stages]
        t0 = min((e.start for s in events for e in s), default=0.0)
        ms = lambda t: (t - t0) * 1e3  # noqa: E731
        fig = Figure(figsize=(10, 0.6 * self.num_stages + 1.4), dpi=100)
        ax = fig.subplots()
        for s, stage_events in enumerate(events):
            for e in stage_events:
                if e.wait > 0:
                    ax.broken_barh([(ms(e.start), e.wait * 1e3)], (s - 0.4, 0.8), color=WAIT_COLOUR)
                ax.broken_barh([(ms(e.start + e.wait), e.busy * 1e3)], (s - 0.4, 0.8),
                               facecolor=COLOURS.get(e.kind, "black"), edgecolor="white", linewidth=0.5)  # fmt: skip
                if self.num_microbatches <= 16 and len(chosen) <= 2:
                    ax.text(ms(e.start + e.wait) + e.busy * 500, s, e.label,
                            ha="center", va="center", fontsize=6, color="white")  # fmt: skip
        ax.set_yticks(range(self.num_stages), [f"stage {s}" for s in range(self.num_stages)])
        ax.set_ylim(self.num_stages - 0.5, -0.5)
        ax.set_xlabel("ms")
        kinds = sorted({e.kind for s in events for e in s}, key="FBIW".find)
        handles = [Patch(color=COLOURS[k], label=k) for k in kinds if k in COLOURS]
        handles.append(Patch(color=WAIT_COLOUR, label="wait"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
        ax.set_title(f"{self.summary()}", fontsize=9)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return path
