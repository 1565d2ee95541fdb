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

The engine of ``map(fn, num_parallel_calls=AUTOTUNE)`` (``use_processes`` unset) is chosen by
the map's first iterator from its real work, with no separate probe, so AUTOTUNE never costs more
than a few elements computed the sequential way (:func:`first_choice`, :func:`after_trial`):

1. The first ``INLINE_ELEMENTS`` elements are computed in the consumer's thread, exactly as the
   sequential ``map`` computes them, timing each call (wall time, the thread's CPU time, and
   the time it sat runnable but queued for a core).
2. A function under ``CHEAP_SECONDS`` per element stays sequential for this iterator (a thread
   pool's hand-off would cost more than the function). One that mostly waits (its thread ran
   under ``WAITS`` of the time it was not queued: sleep, I/O) goes to threads. One that keeps
   its core busy on a machine with a single usable core stays sequential (nothing could run
   beside it; threads would only add hand-offs and GIL switches).
3. A function that keeps its core busy runs on threads for ``THREAD_TRIAL`` elements (and at
   least ``TRIAL_SECONDS``: with sub-millisecond calls a few elements measure mostly the
   pool's start), adding
   up the CPU time their calls took. Threads that take turns holding the GIL keep at most one
   core busy between them however many there are: when the trial's threads kept fewer than
   ``OVERLAP`` cores busy over its wall time (and the consumer was not the bottleneck, taking
   longer per element than the function), the map moves to processes once the elements in
   flight are done, if the work left is worth starting them (``PROCESS_START_SECONDS``; an
   unknown or infinite cardinality always is). When it is not, the map stays on threads if
   their calls took more than one core's CPU over the trial (they ran at once) or under
   ``WAITS`` of one (they mostly waited), and otherwise (about one core: the threads took turns
   on the GIL) goes back to the sequential way once those elements are done: that is slower
   than one thread (measured: 1.37x the sequential time for a 3 ms pure-Python function on
   120 elements). A function whose threads did run in parallel stays on threads (GIL-free
   work: numpy, large tensor ops, hashlib). A machine too busy to give the threads more than
   a core also means processes: a wrong "threads" costs far more than a wrong "processes".

The choice is recorded on the map (later epochs start on that engine, and a map on processes
feeding ``batch`` then builds whole batches in its workers) and logged once at INFO on the
``stratagem.data`` logger.
"""

from __future__ import annotations

import logging
import math
import os

logger = logging.getLogger("stratagem.data")

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


INLINE_ELEMENTS = 2  # elements computed the sequential way before the first choice
CHEAP_SECONDS = 50e-6  # a function cheaper than this per element stays sequential
WAITS = 0.5  # a thread running less than this share of its (unqueued) wall time waits
OVERLAP = 1.3  # threads keeping fewer cores busy than this did not run in parallel
THREAD_TRIAL = 8  # elements measured on threads before a busy function may move to processes
TRIAL_SECONDS = 0.03  # and at least this long: a shorter span is mostly the pool's start
PROCESS_START_SECONDS = 0.25  # about what starting a process pool costs on a loaded machine


def first_choice(per_element: float, busy: float, cores: int) -> str:
    """After the elements computed sequentially: "inline" (stay sequential), "threads", or
    "trial" (threads, measured to see whether they run in parallel). ``per_element``: the
    fastest call's wall seconds; ``busy``: the share of its wall time, less the time it sat
    queued for a core, that the thread ran."""
    if per_element < CHEAP_SECONDS:
        return "inline"
    if busy < WAITS:
        return "threads"
    if cores < 2:
        return "inline"
    return "trial"


def after_trial(cores_busy: float, threads: int, per_element: float,
                consumer_seconds: float | None, remaining: int | None, workers: int) -> str:
    """"threads", "processes" or "sequential" after ``THREAD_TRIAL`` elements on ``threads``
    threads.
    ``cores_busy``: the CPU seconds of their calls over the trial's wall seconds;
    ``per_element``: CPU seconds of one call; ``consumer_seconds``: the consumer's own (median) time
    per element (None: not measured); ``remaining``: elements left (None: unknown or
    infinite); ``workers``: the processes there would be."""
    if threads < 2 or cores_busy >= OVERLAP:
        return "threads"
    if consumer_seconds is not None and consumer_seconds >= per_element:
        return "threads"  # one worker keeps up with the consumer: the engine does not matter
    if remaining is not None:
        saved = remaining * per_element * (1 - 1 / max(workers, 1))
        if saved < 2 * PROCESS_START_SECONDS:
            # threads whose calls took more than one core's CPU ran at once, if not at their
            # best, and calls that mostly waited (little CPU over the trial: sleep, I/O, seen
            # busy only because a loaded machine kept them queued) overlap their waits on
            # threads; threads that kept about one core busy took turns on the GIL, and are
            # slower than one thread
            return "threads" if cores_busy > 1.0 or cores_busy < WAITS else "sequential"
    return "processes"


def run_queue_wait() -> float:
    """Seconds the calling thread has been runnable but waiting for a core (Linux's schedstat
    run delay); 0 elsewhere (other processes then make busy work look like it waits)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return 0.0
