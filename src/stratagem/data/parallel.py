"""Parallel map on a thread pool or a process pool, resumable and in tf order.

Which engine: ``use_processes=True/False`` decides; by default (``num_parallel_calls=AUTOTUNE``,
``use_processes`` unset) the map's first iterator computes its first elements sequentially,
then measures on its real elements whether the function waits or scales on threads (GIL-free
work) or needs processes (small torch ops, pure Python), records the choice on the map and logs
it (see :mod:`stratagem.data.autotune`; there is no separate probe). A map on processes that
feeds ``batch``/``padded_batch`` (through 1:1 maps only) runs with the batch in
batch-building workers (:mod:`stratagem.data.batch_workers`); otherwise elements go through the process pool here.

Process pool: workers are started by :mod:`stratagem.data.procs` (forked on Linux, like
DataLoader's; one torch thread; a watchdog ends them when the parent is gone). ``fn`` reaches
each worker once (inherited by fork, else pickled into the pool initializer). Elements travel
in chunks sized from the measured per-element time so one task is about ``CHUNK_SECONDS`` of
work (the executor's per-task cost is a few hundred microseconds of IPC), with two chunks
queued per worker; results stay per element, so order, resume state, seeds and error
positions do not depend on the chunking. Array leaves cross the process boundary as tensors
in shared memory.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stratagem.data import autotune, procs
from stratagem.data.autotune import Tuner, logger
from stratagem.data.dataset import Dataset
from stratagem.data.functions import call, element_rng, failure, function_name
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import AUTOTUNE
from stratagem.data.structure import flatten, map_structure, nbytes, normalize_output, pack_as

CHUNK_SECONDS = 0.02  # target work per process-pool task
MAX_CHUNK = 64  # most elements per process-pool task
_engine_lock = threading.RLock()  # one AUTOTUNE measurement at a time (they nest)
SNAP_EVERY = 16  # input state saved before every 16th element (a restore replays <= 15)


def _picklable(fn: Callable[..., Any]) -> bool:
    try:
        pickle.dumps(fn)
    except Exception:
        return False
    return True


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class ParallelMapDataset(Dataset):
    """``map`` with ``num_parallel_calls`` workers (threads, or processes when asked)."""

    def __init__(
        self,
        input_ds: Dataset,
        fn: Callable[..., Any],
        num_parallel_calls: int,
        deterministic: bool | None,
        *,
        with_rng: bool,
        seed: int | None,
        use_processes: bool | None,
        name: str | None,
    ) -> None:
        if num_parallel_calls != AUTOTUNE and int(num_parallel_calls) < 1:
            raise ValueError(
                f"map: num_parallel_calls must be >= 1 or AUTOTUNE, got {num_parallel_calls}"
            )
        if use_processes and not procs.forks():
            try:
                pickle.dumps(fn)
            except Exception as e:
                raise TypeError(
                    f"map(use_processes=True) needs a picklable function, but "
                    f"{function_name(fn)} is not ({type(e).__name__}: {e}); define it at module "
                    "level (or use functools.partial of a module-level function), or use threads"
                ) from e
        self._inputs = (input_ds,)
        self._fn, self._n = fn, int(num_parallel_calls)
        self._deterministic = deterministic
        self._with_rng, self._seed = with_rng, seed
        self._use_processes = use_processes
        self._name = name or "map"
        self._engine: str | None = (
            None if use_processes is None and self._n == AUTOTUNE
            else "processes" if use_processes else "threads"
        )

    def engine(self, ctx: Context) -> str | None:
        """"threads" or "processes": as asked, or as an earlier iterator of this AUTOTUNE map
        measured on its real elements, which may also find "sequential" best (see
        :mod:`stratagem.data.autotune`); None while not
        yet measured (the iterator then starts sequential and measures)."""
        return self._engine

    def decided(self, engine: str, reason: str) -> None:
        """Record an AUTOTUNE map's engine, measured by its first iterator (logged once)."""
        with _engine_lock:
            if self._engine is None:
                self._engine = engine
                where = "sequentially" if engine == "sequential" else f"on {engine}"
                logger.info("%s(%s): AUTOTUNE runs it %s (%s; use_processes=True/False "
                            "overrides)", self._name, function_name(self._fn), where, reason)

    def workers(self, ctx: Context, engine: str | None = None) -> int:
        """Threads or processes this map uses (AUTOTUNE: the CPU budget, for processes
        also at most the usable cores)."""
        cap = ctx.options.resolved_cpu_budget
        if (engine or self.engine(ctx)) == "processes":
            cap = min(cap, usable_cpus())
        return cap if self._n == AUTOTUNE else self._n

    def batch_workers(self, ctx: Context) -> int:
        """Processes for batch-building workers (0: this map does not run on them; an AUTOTUNE
        map not yet measured does not, its first iterator measures it)."""
        if self.engine(ctx) != "processes" or not procs.forks():
            return 0
        return self.workers(ctx)

    def _cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _ParallelMapIterator(self, ctx)


def _timed_call(fn: Callable[..., Any], element: Any, seed: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    rng = element_rng(seed) if seed is not None else None
    return normalize_output(call(fn, element, rng)), time.perf_counter() - start


def _measured_call(fn: Callable[..., Any], element: Any, seed: Any) -> tuple[Any, float, float]:
    """:func:`_timed_call` plus the CPU seconds the calling thread spent in it."""
    cpu = time.thread_time()
    value, seconds = _timed_call(fn, element, seed)
    return value, seconds, time.thread_time() - cpu


# -- worker process side -----------------------------------------------------------------
_worker_fn: Callable[..., Any] | None = None


def _init_worker(fn: Callable[..., Any]) -> None:
    global _worker_fn
    _worker_fn = fn
    procs.init_worker()


ChunkResult = tuple[list[Any], tuple[BaseException, str] | None]


def _process_chunk(items: list[tuple[Any, Any]]) -> ChunkResult:
    """Runs in a worker: ``fn`` on each (shared element, seed) in order. Returns the results
    (skeleton, leaves, kinds, seconds) up to the first failure, and that failure (exception,
    formatted traceback) or None."""
    fn = _worker_fn
    assert fn is not None, "process-pool worker without a function"
    results: list[Any] = []
    for element, seed in items:
        try:
            value, seconds = _timed_call(fn, _restore_shared(*element), seed)
            results.append((*_to_shared(value), seconds))
        except Exception as e:
            return results, _portable_error(e)
    return results, None


def _portable_error(e: Exception) -> tuple[BaseException, str]:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        pickle.loads(pickle.dumps(e))
        return e, tb
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e} (unpicklable exception)"), tb


class _RemoteTraceback(Exception):
    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n(in the worker process)\n{self.tb}"


#: Array leaves of at least this many bytes cross the process boundary in shared memory (torch's
#: pickler hands the segment over); smaller ones are copied through the pipe (pickled by value).
#: For a small array the copy is cheaper than a segment per leaf, and it leaves nothing behind:
#: torch names each segment in /dev/shm between creating and unlinking it, so a job killed as a
#: whole (SIGKILL to its process group) at that moment would leave the segment there.
SHARED_MIN_BYTES = 1 << 20

_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128}


def _copyable(t: torch.Tensor) -> bool:
    """A tensor small enough to copy that an array holds exactly (not bfloat16, not on a device)."""
    return (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided
            and not t.requires_grad and t.dtype in _NUMPY_DTYPES and t.nbytes < SHARED_MIN_BYTES)


def _to_shared(element: Any) -> tuple[Any, list[Any], list[str]]:
    """(skeleton, leaves, kinds): large array leaves become tensors, which torch's pickler moves
    to shared memory instead of copying their bytes through the pipe; small tensors become arrays,
    which are copied (``SHARED_MIN_BYTES``)."""
    leaves: list[Any] = []
    kinds: list[str] = []
    for leaf in flatten(element):
        numeric = isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biuf" and leaf.dtype != np.uint16
        if numeric and leaf.nbytes >= SHARED_MIN_BYTES:
            leaves.append(torch.from_numpy(np.ascontiguousarray(leaf)))
            kinds.append("numpy")
        elif isinstance(leaf, torch.Tensor) and _copyable(leaf):
            leaves.append(leaf.numpy())
            kinds.append("tensor")
        else:
            leaves.append(leaf)
            kinds.append("")
    return map_structure(lambda _: None, element), leaves, kinds


def _restore_shared(skeleton: Any, leaves: list[Any], kinds: list[str]) -> Any:
    restored = [x.numpy() if k == "numpy" else torch.from_numpy(x) if k == "tensor" else x
                for x, k in zip(leaves, kinds)]
    return pack_as(skeleton, restored)


class _Entry:
    """One input element: its position, the input state before it, and (once submitted) the
    future computing it (for processes, ``index`` is its place in the future's chunk)."""

    __slots__ = ("pos", "snap", "future", "index", "yielded")

    def __init__(self, pos: int, snap: Any, yielded: bool) -> None:
        self.pos, self.snap, self.yielded = pos, snap, yielded
        self.future: cf.Future | None = None
        self.index = 0


class _ParallelMapIterator(StatefulIterator):
    """Keeps up to p elements in flight (2 p chunks with processes); state = input state before
    the oldest element not yet returned, plus the positions after it already returned
    (deterministic=False)."""

    def __init__(self, ds: ParallelMapDataset, ctx: Context) -> None:
        self.ds, self.ctx = ds, ctx
        self.child = ds._inputs[0]._make_iterator(ctx.child(0))
        self.children = [self.child]
        options = ctx.options
        self.deterministic = (
            options.resolved_deterministic if ds._deterministic is None else ds._deterministic
        )
        engine = ds.engine(ctx)
        # an AUTOTUNE map not yet measured starts sequential ("inline"): see autotune's doc
        self.mode = engine or "inline"
        self.processes = engine == "processes"
        self.max_workers = ds.workers(ctx, "threads" if engine is None else engine)
        self.tuner = Tuner(self.max_workers, options.resolved_ram_budget)
        self.samples: list[tuple[float, float]] = []  # (seconds, busy share) being measured
        self.switch_to_processes = False
        self.switch_to_sequential = False
        self.trial_start = 0.0
        self.pool: cf.Executor | None = None
        self.inflight: collections.deque[_Entry] = collections.deque()
        self.npending = 0  # entries in self.inflight not yet yielded
        self.pos = 0
        self.skip: set[int] = set()
        self.since_snap = SNAP_EVERY  # elements read since the last input snapshot
        self.anchor: tuple[Any, int] = (None, 0)  # the last snapshot of a purged entry
        self.input_done = False
        self.last_return: float | None = None
        # while measuring (inline elements, thread trial): the consumer's own seconds per
        # element, less the time its thread sat queued for a core (a busy machine's preemption
        # is not the consumer's work)
        self.consumer: list[float] = []
        self.returned_queued: float | None = None
        self.closed = False

    # -- execution -------------------------------------------------------------------
    def _pool(self) -> cf.Executor:
        if self.pool is None:
            if self.processes:
                procs.check_can_start(f"{self.ds._name}({function_name(self.ds._fn)})")
                self.pool = cf.ProcessPoolExecutor(
                    self.max_workers,
                    mp_context=procs.process_context(),
                    initializer=_init_worker,
                    initargs=(self.ds._fn,),
                )
            else:
                self.pool = cf.ThreadPoolExecutor(
                    self.max_workers, thread_name_prefix="stratagem-map"
                )
        return self.pool

    def _plan(self) -> tuple[int, int]:
        """(elements to keep in flight, elements per task)."""
        p = self.tuner.parallelism() if self.ds._n == AUTOTUNE else self.max_workers
        if not self.processes:
            return p, 1
        chunk = 1
        per_element = self.tuner.produce.value
        if self.tuner.produce.count >= 4 and per_element is not None:
            chunk = int(min(MAX_CHUNK, max(1.0, CHUNK_SECONDS / max(per_element, 1e-7))))
        # two tasks queued per worker hide the pipe round trip; memory caps the elements
        chunk = max(1, min(chunk, self.tuner.memory_cap() // (2 * p)))
        return 2 * p * chunk, chunk

    def _start_processes(self) -> None:
        self.switch_to_processes = False
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        self.mode, self.processes = "processes", True
        self.max_workers = self.ds.workers(self.ctx, "processes")
        self.tuner.max_parallelism = max(1, self.max_workers)

    def _back_to_sequential(self) -> None:
        """After a trial whose threads took turns on the GIL, with too little work left to
        start processes: the rest is computed the sequential map's way."""
        self.switch_to_sequential = False
        self._purge()
        assert not self.inflight
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        self.mode = "sequential"

    def _inline_next(self) -> Any:
        """One element computed in the consumer's thread (the sequential map's way), timed."""
        while True:
            x = next(self.child)
            pos = self.pos
            self.pos += 1
            if pos in self.skip:
                self.skip.discard(pos)
                continue
            break
        seed = self.ctx.seed_sequence(self.ds._seed, pos) if self.ds._with_rng else None
        queued = autotune.run_queue_wait()
        try:
            value, seconds, cpu = _measured_call(self.ds._fn, x, seed)
        except Exception as e:
            self.close()
            raise failure(self.ds._name, self.ds._fn, pos, e) from e
        queued = autotune.run_queue_wait() - queued
        self.samples.append((seconds, cpu / max(seconds - queued, cpu, 1e-9)))
        if len(self.samples) >= autotune.INLINE_ELEMENTS:
            self._choose_first()
        return value

    def _choose_first(self) -> None:
        per = min(t for t, _ in self.samples)
        busy = max(b for _, b in self.samples)
        choice = autotune.first_choice(per, busy, usable_cpus())
        self.samples = []
        if choice == "inline":
            self.mode = "sequential"  # this iterator stays sequential; the next one measures
            return
        self.mode = "threads" if choice == "threads" else "trial"
        self.trial_start = time.perf_counter()
        if choice == "threads":
            why = ("one core" if usable_cpus() < 2 else
                   f"it waits: its thread ran {busy:.0%} of {per * 1e3:.2f} ms per element")
            self.ds.decided("threads", why)

    def _trial_sample(self, seconds: float, cpu: float) -> None:
        self.samples.append((seconds, cpu))
        span = time.perf_counter() - self.trial_start
        if len(self.samples) < autotune.THREAD_TRIAL or span < autotune.TRIAL_SECONDS:
            return
        cores = sum(c for _, c in self.samples) / max(span, 1e-9)
        per = sorted(c for _, c in self.samples)[len(self.samples) // 2]
        self.samples = []
        n = self.ds._inputs[0].cardinality()
        remaining = max(0, n - self.pos) if n >= 0 else None
        workers = min(self.ctx.options.resolved_cpu_budget, usable_cpus())
        consumer = sorted(self.consumer)[len(self.consumer) // 2] if self.consumer else None
        choice = autotune.after_trial(cores, self.max_workers, per, consumer, remaining, workers)
        if choice == "processes" and not (procs.forks() or _picklable(self.ds._fn)):
            choice = "threads"
        self.mode = "threads"
        why = (f"{self.max_workers} threads kept {cores:.2f} cores busy, "
               f"{per * 1e3:.2f} ms of CPU per element")
        if choice == "sequential":
            why += f"; {remaining} elements left are too few to pay for starting processes"
        elif choice == "threads" and cores < autotune.OVERLAP and consumer is not None:
            why += f"; the consumer takes {consumer * 1e3:.2f} ms per element"
        self.ds.decided(choice, why)
        if choice == "processes":
            self.switch_to_processes = True
        elif choice == "sequential":
            self.switch_to_sequential = True

    def _submit(self, batch: list[tuple[_Entry, Any]]) -> None:
        fn, pool = self.ds._fn, self._pool()
        seeds = [
            self.ctx.seed_sequence(self.ds._seed, e.pos) if self.ds._with_rng else None
            for e, _ in batch
        ]
        if self.processes:
            items = [(_to_shared(x), seed) for (_, x), seed in zip(batch, seeds)]
            future = pool.submit(_process_chunk, items)
            for i, (entry, _) in enumerate(batch):
                entry.future, entry.index = future, i
        else:
            call_fn = _measured_call if self.mode == "trial" else _timed_call
            for (entry, x), seed in zip(batch, seeds):
                entry.future = pool.submit(call_fn, fn, x, seed)

    def _fill(self) -> None:
        if self.mode == "inline":
            return
        if self.switch_to_sequential:
            if self.npending:
                return  # the thread trial's elements finish first
            self._back_to_sequential()
            return
        if self.switch_to_processes:
            if self.npending:
                return  # the thread trial's elements finish first
            self._start_processes()
        target, chunk = self._plan()
        if self.npending > target - chunk:
            return  # refill only a whole chunk at a time
        batch: list[tuple[_Entry, Any]] = []
        try:
            while not self.input_done and self.npending < target:
                snap = None
                if self.since_snap >= SNAP_EVERY:  # state_dict may cost O(buffer) (shuffle)
                    snap, self.since_snap = self.child.state_dict(), 0
                self.since_snap += 1
                try:
                    x = next(self.child)
                except StopIteration:
                    self.input_done = True
                    break
                pos = self.pos
                self.pos += 1
                if pos in self.skip:
                    self.skip.discard(pos)
                    self.inflight.append(_Entry(pos, snap, True))
                    continue
                entry = _Entry(pos, snap, False)
                self.inflight.append(entry)
                self.npending += 1
                batch.append((entry, x))
                if len(batch) >= chunk:
                    self._submit(batch)
                    batch = []
        finally:
            if batch:
                self._submit(batch)

    def _purge(self) -> None:
        while self.inflight and self.inflight[0].yielded:
            e = self.inflight.popleft()
            if e.snap is not None:
                self.anchor = (e.snap, e.pos)

    def _fail(self, entry: _Entry, e: BaseException) -> Exception:
        self.close()
        return failure(self.ds._name, self.ds._fn, entry.pos, e)

    def _result(self, entry: _Entry) -> tuple[Any, float]:
        """The element's value and its worker seconds; raises the named failure."""
        assert entry.future is not None
        try:
            result = entry.future.result()
        except Exception as e:
            raise self._fail(entry, e) from e
        if not self.processes:
            if len(result) == 3:  # measured during the thread trial
                self._trial_sample(result[1], result[2])
            return result[0], result[1]
        results, error = result
        if entry.index < len(results):
            skeleton, leaves, kinds, seconds = results[entry.index]
            results[entry.index] = None  # free it before the rest of the chunk is taken
            return _restore_shared(skeleton, leaves, kinds), seconds
        assert error is not None and entry.index == len(results)
        exc, tb = error
        exc.__cause__ = _RemoteTraceback(tb)
        raise self._fail(entry, exc) from exc

    def __next__(self) -> Any:
        if self.mode == "sequential" and not self.skip and not self.closed:
            # a cheap function: exactly the sequential map's work
            x = next(self.child)
            pos = self.pos
            self.pos = pos + 1
            ds = self.ds
            rng = element_rng(self.ctx.seed_sequence(ds._seed, pos)) if ds._with_rng else None
            try:
                return normalize_output(call(ds._fn, x, rng))
            except Exception as error:
                self.close()
                raise failure(ds._name, ds._fn, pos, error) from error
        if self.mode == "sequential":
            return self._sequential_next()
        if self.closed:
            raise StopIteration
        if self.last_return is not None:
            between = time.perf_counter() - self.last_return
            self.tuner.consume.add(between)
            if self.returned_queued is not None:
                queued = autotune.run_queue_wait() - self.returned_queued
                self.consumer.append(max(0.0, between - queued))
                self.returned_queued = None
        if self.mode == "inline":
            value = self._inline_next()
            self._returning()
            return value
        self._purge()
        self._fill()
        if self.mode == "sequential":
            return self._sequential_next()
        if not self.npending:
            raise StopIteration
        if self.deterministic:
            entry = next(e for e in self.inflight if not e.yielded)
        else:
            by_future: dict[Any, list[_Entry]] = {}
            for e in self.inflight:
                if not e.yielded:
                    by_future.setdefault(e.future, []).append(e)
            done, _ = cf.wait(list(by_future), return_when=cf.FIRST_COMPLETED)
            entry = min((e for f in done for e in by_future[f]), key=lambda e: e.pos)
        value, seconds = self._result(entry)
        entry.yielded, entry.future = True, None
        self.npending -= 1
        self._purge()
        self.tuner.produce.add(seconds)
        if self.ds._n == AUTOTUNE and self.tuner.element_bytes.count < 16:
            self.tuner.element_bytes.add(nbytes(value))
        self._fill()  # start the next elements before handing this one out
        self._returning()
        return value

    def _returning(self) -> None:
        if self.mode in ("inline", "trial"):
            self.returned_queued = autotune.run_queue_wait()
        self.last_return = time.perf_counter()

    def _sequential_next(self) -> Any:
        if self.closed:
            raise StopIteration
        while True:
            x = next(self.child)
            pos = self.pos
            self.pos += 1
            if pos not in self.skip:
                break
            self.skip.discard(pos)
        rng = element_rng(self.ctx.seed_sequence(self.ds._seed, pos)) if self.ds._with_rng else None
        try:
            return normalize_output(call(self.ds._fn, x, rng))
        except Exception as e:
            self.close()
            raise failure(self.ds._name, self.ds._fn, pos, e) from e

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        pending = [e for e in self.inflight if not e.yielded]
        if pending:
            base = pending[0]
            before = [e for e in self.inflight if e.pos <= base.pos and e.snap is not None]
            snap, start = (before[-1].snap, before[-1].pos) if before else self.anchor
            # everything from the snapshot to the oldest pending element was consumed
            done = set(range(start, base.pos)) | self.skip
            done |= {e.pos for e in self.inflight if e.yielded and e.pos > base.pos}
            return {"input": snap, "pos": start, "skip": sorted(done)}
        return {"input": self.child.state_dict(), "pos": self.pos, "skip": sorted(self.skip)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])
        self.pos = int(state["pos"])
        self.skip = {int(p) for p in state["skip"]}

    def close(self) -> None:
        self.closed = True
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self.inflight.clear()
        self.npending = 0
        self.child.close()
