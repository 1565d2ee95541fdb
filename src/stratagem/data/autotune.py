"""AUTOTUNE: parallelism and buffer sizes from measured rates, bounded by a memory budget.

The algorithm, per parallel stage (kept deliberately simple):

* The stage measures ``t_p``, the mean time one worker takes to produce an element
  (exponential moving average over elements), and ``t_c``, the mean time the consumer spends
  between two requests when it did not have to wait (how fast it *could* take elements).
* Parallelism ``p = ceil(t_p / t_c) + 1``: just enough workers that production keeps up with
  consumption, plus one of slack; clipped to ``[1, cpu_budget]``.
* Buffers (prefetch depth, elements in flight) start small and grow by one each time the
  consumer finds them empty, up to ``MAX_BUFFER``.
* Both are capped so buffered bytes stay within ``ram_budget`` divided among the stages that
  share it: ``p * mean_element_bytes <= ram_budget / STAGE_SHARE``.

Until a few elements have been measured, ``p`` is the number of CPU cores.
"""

from __future__ import annotations

import math
import os

MAX_BUFFER = 64
STAGE_SHARE = 4  # a stage may use at most 1/STAGE_SHARE of the ram budget
_ALPHA = 0.2


class Ema:
    """Exponential moving average (``None`` until the first sample)."""

    def __init__(self) -> None:
        self.value: float | None = None
        self.count = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - _ALPHA) * self.value + _ALPHA * x
        self.count += 1


class Tuner:
    """Measured rates of one stage and the parallelism/buffer they call for."""

    def __init__(self, max_parallelism: int, ram_budget: int) -> None:
        self.max_parallelism = max(1, int(max_parallelism))
        self.ram_budget = int(ram_budget)
        self.produce = Ema()
        self.consume = Ema()
        self.element_bytes = Ema()
        self.buffer = 1

    def memory_cap(self) -> int:
        if self.element_bytes.value is None or self.element_bytes.value <= 0:
            return MAX_BUFFER * self.max_parallelism
        return max(1, int(self.ram_budget / STAGE_SHARE / self.element_bytes.value))

    def parallelism(self) -> int:
        """Workers (or elements in flight) this stage should use now."""
        if self.produce.count < 4 or self.consume.value is None:
            p = os.cpu_count() or 1
        else:
            assert self.produce.value is not None
            p = math.ceil(self.produce.value / max(self.consume.value, 1e-5)) + 1
        return max(1, min(p, self.max_parallelism, self.memory_cap()))

    def starved(self) -> None:
        """The consumer found the buffer empty: allow one more buffered element."""
        self.buffer = min(self.buffer + 1, MAX_BUFFER)

    def buffer_size(self) -> int:
        return max(1, min(self.buffer, self.memory_cap()))
