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

The engine of ``map(fn, num_parallel_calls=AUTOTUNE)`` (``use_processes`` unset) is chosen
once per map by :func:`choose_engine`: with torch on one intra-op thread (as workers run it),
it computes a small sample of the map's first elements
(a separate iterator over its input, results discarded) on one thread, then the same sample on
``P = min(cores, 4)`` threads at once. Speed-up ``>= SCALES * P`` means the function releases the
GIL (file reads, numpy, large tensor ops): threads. For mostly-CPU work the speed-up counts
only what CPU time confirms (see :func:`thread_speedup`), so another process slowing the serial
run cannot make GIL-bound work look parallel. Below that, the same is measured for a
GIL-free reference (hashlib), the scaling the machine offers right now (other jobs may share
it): a function reaching ``SCALES`` of the reference's speed-up runs on threads, one that does
not (small torch ops, pure Python) on processes, which run torch with one intra-op thread each;
a machine too busy to tell means processes (see :func:`decide`). A cheap function
(under ``CHEAP_SECONDS`` per element), a failing one (the pipeline then reports the error at its
position) or a single core means threads. The choice is logged once at INFO on the
``stratagem.data`` logger.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from stratagem.data.iterator import Context
    from stratagem.data.parallel import ParallelMapDataset

logger = logging.getLogger("stratagem.data")

SCALES = 0.75  # threads scale when P threads are at least this fraction of P times faster
CHEAP_SECONDS = 20e-6  # a function cheaper than this per element stays on threads
PROBE_SECONDS = 0.02  # one pass over the probe's sample aims at about this much work
OVERLAP = 1.2  # probe threads of mostly-CPU work keeping fewer cores busy at once did not overlap

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


def thread_speedup(run: Callable[[], None], threads: int, repeats: int = 3) -> float:
    """How many times faster ``threads`` threads each calling ``run`` once finish than one
    thread calling it ``threads`` times (1.0: no scaling, ``threads``: perfect). Each side is
    the fastest of ``repeats`` runs, so a stall from another process does not decide it.

    Wall-clock time alone misleads on a shared machine: a serial run slowed by other processes
    makes GIL-bound threads look like they scale (1.75x on 2 threads, pure Python, seen on a
    loaded 2-core CI machine). So for mostly-CPU work (the serial run kept its thread on a core
    at least half the time it was not waiting for one) the result is also bounded by the
    threads' own CPU time: ``cores``, the cores they kept busy at once, over the serial run's
    share. Holding the GIL keeps ``cores`` at or under 1 however busy the machine is, and
    without clear overlap (``cores < OVERLAP``) the result is at most 1.0. Work that mostly
    waits (I/O, sleep) is measured by wall time."""
    errors: list[BaseException] = []
    spent: list[float] = []  # CPU seconds of each probe thread

    def work() -> None:
        start = time.thread_time()
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        spent.append(time.thread_time() - start)

    serial = parallel = float("inf")
    busy = cores = 0.0
    for _ in range(repeats):
        cpu, queued, wall = time.thread_time(), _run_queue_wait(), time.perf_counter()
        run()
        wall = time.perf_counter() - wall
        cpu, queued = time.thread_time() - cpu, _run_queue_wait() - queued
        serial = min(serial, wall)
        busy = max(busy, cpu / max(wall - queued, 1e-9))
        spent.clear()
        pool = [threading.Thread(target=work, name="stratagem-probe") for _ in range(threads)]
        wall = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        wall = time.perf_counter() - wall
        if errors:
            raise errors[0]
        if wall < parallel:
            parallel, cores = wall, sum(spent) / max(wall, 1e-9)
    speedup = threads * serial / max(parallel, 1e-9)
    if busy < 0.5:
        return speedup
    if cores < OVERLAP:
        return min(speedup, 1.0)
    return min(speedup, cores / busy)


def _run_queue_wait() -> float:
    """Seconds the calling thread has been runnable but waiting for a core (Linux's schedstat
    run delay); 0 elsewhere (other processes then make work look like it waits, and wall time
    decides)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return 0.0


def _warm_up(call: Callable[[], None], budget: float = 0.2) -> float:
    """Call until the time per call settles (first calls pay one-time costs); the last time."""
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < 20:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        if len(times) >= 3 and max(times[-3:]) <= 1.5 * min(times[-3:]):
            break
        if time.perf_counter() > deadline:
            break
    return min(times[-3:])


def choose_engine(ds: ParallelMapDataset, ctx: Context) -> str:
    """"threads" or "processes" for an AUTOTUNE map, by measurement (see module doc)."""
    from stratagem.data.functions import function_name

    what = f"{ds._name}({function_name(ds._fn)})"
    cores = os.cpu_count() or 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        pass
    if cores < 2:
        logger.info("%s: AUTOTUNE runs it on threads (one core)", what)
        return "threads"
    # measured as the workers would run: one intra-op thread (else the serial run's own
    # intra-op threads, stalled by other jobs, can make threads look like they scale)
    intra = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(ds, ctx, what, cores)
    finally:
        torch.set_num_threads(intra)


def _measure(ds: ParallelMapDataset, ctx: Context, what: str, cores: int) -> str:
    from stratagem.data.functions import call, element_rng

    fn = ds._fn

    def one(x: Any, pos: int) -> None:
        rng = element_rng(ctx.seed_sequence(ds._seed, pos)) if ds._with_rng else None
        call(fn, x, rng)

    sample: list[Any] = []
    try:
        it = ds._inputs[0]._make_iterator(ctx.child(0))
        try:
            first = next(it)
            per = _warm_up(lambda: one(first, 0))
            n = int(min(64, max(8, PROBE_SECONDS / max(per, 1e-7))))
            sample = [first]
            for _ in range(n - 1):
                sample.append(next(it))
        except StopIteration:
            pass
        finally:
            it.close()
        if len(sample) < 2:
            logger.info("%s: AUTOTUNE runs it on threads (too few elements to measure)", what)
            return "threads"

        def run() -> None:
            for i, x in enumerate(sample):
                one(x, i)

        start = time.perf_counter()
        run()
        per = (time.perf_counter() - start) / len(sample)
        if per < CHEAP_SECONDS:
            logger.info("%s: AUTOTUNE runs it on threads (%.1f us per element is too cheap to "
                        "ship to processes)", what, per * 1e6)
            return "threads"
        p = min(cores, 4)
        speedup = thread_speedup(run, p)
        # what the machine gives GIL-free work on p threads right now (other jobs share it)
        reference = thread_speedup(_gil_free_work, p) if speedup < SCALES * p else float(p)
    except Exception as e:  # noqa: BLE001 - the pipeline reports it where it belongs
        logger.info("%s: AUTOTUNE runs it on threads (measuring failed: %s: %s)", what,
                    type(e).__name__, e)
        return "threads"
    engine = decide(speedup, reference, p)
    logger.info(
        "%s: AUTOTUNE runs it on %s (%.2fx faster on %d threads than on one, GIL-free work "
        "%.2fx; %.3f ms per element; use_processes=True/False overrides)",
        what, engine, speedup, p, reference, per * 1e3,
    )
    return engine


def decide(speedup: float, reference: float, threads: int) -> str:
    """The engine from measured speed-ups on ``threads`` threads: of the function, and of
    GIL-free reference work (the scaling the machine offers now). Clear scaling means threads;
    a busy machine (the reference hardly scales) cannot show the difference, and a wrong
    "threads" costs far more than a wrong "processes": processes."""
    if speedup >= SCALES * threads:
        return "threads"
    if reference < 1 + 0.5 * (threads - 1):
        return "processes"
    return "threads" if speedup >= SCALES * reference else "processes"


_REFERENCE = bytes(1 << 20)


def _gil_free_work() -> None:
    for _ in range(4):
        hashlib.sha256(_REFERENCE).digest()  # hashlib releases the GIL on large buffers
