"""Batch-building worker processes: ``map(fn, num_parallel_calls)`` followed by element-wise
maps and ``batch``/``padded_batch`` runs as one segment in forked workers, each of which builds
whole batches and hands each over once, in shared memory.

The main process reads the map's input, packs one batch's worth of elements per task into a
shared arena (one stacked copy per component) and sends a small message; a worker runs every
map of the segment on each element (same per-element seeds and positions as the sequential
pipeline), stacks the batch straight into its own arena (``torch.stack(out=...)``) and replies
with the layout. The batch the consumer receives views that arena; when it is dropped, the
arena goes back to the worker for a later batch. The output equals the sequential pipeline's
bit for bit, in order (``deterministic=False`` lets a finished batch overtake an earlier one
when no map sits between the parallel map and the batch); the iterator state has the same
format as the unfused chain's, so states move between engines and resume exactly; an element
error names the stage and position the sequential pipeline would, with the worker's traceback
as ``err.__cause__.__cause__``; a worker killed by the OS is a ``WorkerDiedError`` naming the
segment.
"""

from __future__ import annotations

import collections
import functools
import pickle
import threading
import weakref
from multiprocessing import connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import TYPE_CHECKING, Any, NoReturn

from stratagem.data import procs, sharedmem
from stratagem.data.autotune import STAGE_SHARE
from stratagem.data.functions import failure
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.prefetch import PipelineClosed
from stratagem.data.segment import (  # noqa: F401 - find_segment, pm_context: batching's API
    Keep,
    Segment,
    _send,
    _worker_main,
    find_segment,
    pm_context,
    stages,
)

if TYPE_CHECKING:
    from stratagem.data.batching import BatchDataset

TASKS_PER_WORKER = 2  # batches queued per worker: one computing, one waiting


class WorkerDiedError(RuntimeError):
    """A pipeline worker process ended without a result (killed by the OS, or it crashed)."""


# -- main process ------------------------------------------------------------------------
class _Task:
    __slots__ = ("id", "snap", "positions", "skipped", "qs", "worker", "arena", "result",
                 "returned", "error_after", "collate")

    def __init__(self, tid: int) -> None:
        self.id = tid
        self.snap: Any = None
        self.positions: list[int] = []
        self.skipped: list[int] = []
        self.qs: list[int] = []
        self.worker: _Worker | None = None
        self.arena: int | None = None
        self.result: Any = None
        self.returned = False
        self.error_after: BaseException | None = None
        self.collate = True


class ArenaPool:
    """Free output arenas kept between iterators of one ``batch`` (its epochs): the next
    workers inherit them at fork, pages already in memory, instead of faulting in fresh
    zeroed pages for every batch (which costs as much as stacking the batch)."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap, self.lock = cap_bytes, threading.RLock()  # finalizers may re-enter
        self.free: list[sharedmem.Arena] = []

    def put(self, arena: sharedmem.Arena) -> None:
        with self.lock:
            if sum(a.size for a in self.free) + arena.size <= self.cap:
                self.free.append(arena)

    def take_all(self) -> list[sharedmem.Arena]:
        with self.lock:
            free, self.free = self.free, []
            return free


_pools: weakref.WeakKeyDictionary[Any, ArenaPool] = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def arena_pool(batch: BatchDataset, cap_bytes: int = 0) -> ArenaPool:
    """The pool of free arenas of this ``batch`` node (kept while the node lives; not an
    attribute, so the plan stays picklable)."""
    with _pools_lock:
        pool = _pools.get(batch)
        if pool is None:
            pool = _pools[batch] = ArenaPool(cap_bytes)
        return pool


class _Worker:
    def __init__(self, index: int, proc: Any, conn: Any, pool: ArenaPool,
                 initial: list[sharedmem.Arena]) -> None:
        self.index, self.proc, self.conn, self.pool = index, proc, conn, pool
        self.inputs: dict[int, sharedmem.Arena] = {}
        self.free_inputs: list[int] = []
        self.outputs: dict[int, sharedmem.Arena] = dict(enumerate(initial))
        self.busy: set[int] = set()  # arenas viewed by batches handed out
        self.released: collections.deque[int] = collections.deque()  # to send to the worker
        self.tasks = 0
        self.stopped = False
        self.lock = threading.RLock()  # a finalizer may run on_release inside a locked call

    def handed_out(self, arena_id: int) -> None:
        with self.lock:
            self.busy.add(arena_id)

    def on_release(self, arena_id: int) -> None:
        """A batch viewing this arena is gone (a finalizer, in any thread)."""
        with self.lock:
            self.busy.discard(arena_id)
            if not self.stopped:
                self.released.append(arena_id)
            else:
                arena = self.outputs.pop(arena_id, None)
                if arena is not None:
                    self.pool.put(arena)

    def stop(self) -> None:
        """After the process ended: its free arenas go to the pool, the busy ones later."""
        with self.lock:
            self.stopped = True
            for aid in [a for a in self.outputs if a not in self.busy]:
                arena = self.outputs.pop(aid, None)
                if arena is not None:
                    self.pool.put(arena)


class BatchWorkersIterator(StatefulIterator):
    """The main-process side of a segment run by batch-building workers."""

    def __init__(self, segment: Segment, ctx: Context, workers: int) -> None:
        self.seg, self.ctx = segment, ctx
        pm = segment.pm
        self.stages, pm_ctx = stages(segment, ctx)
        self.child = pm._inputs[0]._make_iterator(pm_ctx.child(0))
        self.children = [self.child]
        options = ctx.options
        deterministic = options.resolved_deterministic if pm._deterministic is None else (
            pm._deterministic)
        self.in_order = deterministic or bool(segment.steps)
        self.nworkers = max(1, workers)
        self.budget = options.resolved_ram_budget // STAGE_SHARE
        self.pool = arena_pool(segment.batch, options.resolved_ram_budget // 2)
        self.batch_bytes = 0
        self.workers: list[_Worker] = []
        self.sources: sharedmem.Sources | None = None
        self.tasks: collections.deque[_Task] = collections.deque()
        self.next_tid = 0
        self.pos = 0
        self.skip: set[int] = set()
        self.q = [0] * len(segment.steps)
        self.input_done = False
        self.closed = False
        self.lock = threading.RLock()  # close() may come from another thread or a finalizer

    # -- workers -------------------------------------------------------------------
    def _start(self) -> None:
        procs.check_can_start(self.seg.describe())
        mine = [w.conn.fileno() for w in self.workers]
        self.sources = sharedmem.Sources(self.seg.pm._inputs[0]) if procs.forks() else None
        inherited = self.pool.take_all() if procs.forks() else []
        for i in range(self.nworkers):
            parent, child = procs.process_context().Pipe(duplex=True)
            initial = inherited[i::self.nworkers]
            proc = procs.start(
                _worker_main,
                (child, self.stages, self.seg.batch, self.sources, initial,
                 [*mine, parent.fileno()]),
                name=f"stratagem-batch-{i}",
            )
            child.close()
            self.workers.append(_Worker(i, proc, parent, self.pool, initial))
            mine.append(parent.fileno())

    def _target(self) -> int:
        tasks = TASKS_PER_WORKER * self.nworkers
        if self.batch_bytes:
            tasks = min(tasks, max(self.nworkers, self.budget // self.batch_bytes))
        return tasks

    # -- feeding -------------------------------------------------------------------
    def _read(self) -> _Task | None:
        task = _Task(self.next_tid)
        task.qs = list(self.q)
        elements: list[Any] = []
        kept = 0
        size = self.seg.batch.batch_size
        try:
            while kept < size:
                snap = self.child.state_dict() if not elements else None
                try:
                    x = next(self.child)
                except StopIteration:
                    self.input_done = True
                    break
                p = self.pos
                self.pos += 1
                if p in self.skip:
                    self.skip.discard(p)
                    if elements:
                        task.skipped.append(p)
                    continue
                if not elements:
                    task.snap = snap
                elements.append(x)
                task.positions.append(p)
                kept += self._advance()
        except PipelineClosed:
            raise
        except Exception as e:  # the input failed: raise it where the sequential one would
            self.input_done = True
            task.error_after = e
            if not elements:
                task.snap = self.child.state_dict()
        if not elements and task.error_after is None:
            return None
        self.next_tid += 1
        task.collate = task.error_after is None and kept > 0 and not (
            self.seg.batch.drop_remainder and kept < size
        )
        if elements:
            self._send(task, elements)
        else:
            task.result = ("done", task.id, None, None, None, [])
        return task

    def _advance(self) -> bool:
        """One more element enters the steps: their position counters move as in the
        sequential pipeline; whether it reaches the batch (shards may drop it)."""
        for k, step in enumerate(self.stages[1:]):
            pos = self.q[k]
            self.q[k] += 1
            if isinstance(step, Keep) and not step(pos):
                return False
        return True

    def _send(self, task: _Task, elements: list[Any]) -> None:
        if not self.workers:
            self._start()
        w = min(self.workers, key=lambda w: (w.tasks, w.index))
        skel, descs, need = sharedmem.plan_inputs(elements, self.sources)
        aid = None
        if need:
            fits = [a for a in w.free_inputs if w.inputs[a].size >= need]
            if fits:
                aid = min(fits, key=lambda a: w.inputs[a].size)
                w.free_inputs.remove(aid)
            else:
                for a in w.free_inputs:  # too small for this task: replace it
                    del w.inputs[a]
                w.free_inputs.clear()
                aid = max(w.inputs, default=-1) + 1
                arena = sharedmem.Arena(need)
                w.inputs[aid] = arena
                try:
                    _send(w.conn, ("arena", aid, arena.size))
                    assert arena.fd is not None
                    send_handle(w.conn, arena.fd, w.proc.pid)
                except OSError:  # the worker is gone
                    self._died(w)
                arena.close_fd()
        sent = sharedmem.write_inputs(descs, w.inputs[aid] if aid is not None else None)
        released = []
        while w.released:
            released.append(w.released.popleft())
        try:
            _send(w.conn, ("task", task.id, aid, skel, sent, task.positions, task.qs,
                           task.collate, released))
        except OSError:
            self._died(w)
        task.worker, task.arena = w, aid
        w.tasks += 1

    def _fill(self) -> None:
        while not self.input_done and len(
            [t for t in self.tasks if not t.returned]
        ) < self._target():
            task = self._read()
            if task is None:
                break
            self.tasks.append(task)

    # -- receiving -----------------------------------------------------------------
    def _receive(self, w: _Worker) -> None:
        msg = pickle.loads(w.conn.recv_bytes())
        task = next(t for t in self.tasks if t.id == msg[1])
        if msg[0] == "done" and msg[3] is not None:  # a new output arena: its fd follows
            w.outputs[msg[2]] = sharedmem.Arena(msg[3], recv_handle(w.conn))
        if msg[0] == "done":
            with w.lock:
                for a in msg[5]:
                    w.outputs.pop(a, None)
        task.result = msg
        w.tasks -= 1
        if task.arena is not None:
            w.free_inputs.append(task.arena)

    def _wait(self, want: list[_Task]) -> _Task:
        """Block until one of ``want`` has its result (never forever: a dead worker raises)."""
        while True:
            done = [t for t in want if t.result is not None]
            if done:
                return done[0]
            busy = [w for w in self.workers if w.tasks]
            if not busy:
                if self.closed:
                    raise PipelineClosed("batch workers were closed")
                raise RuntimeError("batch workers: waiting for a batch no worker is building")
            sentinels = {w.proc.sentinel: w for w in busy}
            try:
                ready = connection.wait([w.conn for w in busy] + list(sentinels), timeout=1.0)
            except (OSError, ValueError):
                if self.closed:
                    raise PipelineClosed("batch workers were closed") from None
                raise
            for r in ready:
                if r in sentinels:
                    continue
                w = next(w for w in busy if w.conn is r)
                try:
                    self._receive(w)
                except (EOFError, OSError):
                    self._died(w)
            if self.closed:
                raise PipelineClosed("batch workers were closed")
            for s in ready:
                if s in sentinels and not sentinels[s].conn.poll():
                    self._died(sentinels[s])

    def _died(self, w: _Worker) -> NoReturn:
        if self.closed:
            raise PipelineClosed("batch workers were closed")
        w.proc.join(1.0)
        how = procs.describe_exit(w.proc.exitcode)
        pending = [t for t in self.tasks if t.worker is w and t.result is None]
        what = f" while building batch {pending[0].id}" if pending else ""
        self.close()
        raise WorkerDiedError(
            f"{self.seg.describe()}: worker process {w.proc.pid} ({w.index + 1} of "
            f"{self.nworkers}) {how}{what}; the pipeline is closed. If it ran out of memory, "
            "use a smaller batch or fewer workers (num_parallel_calls), or set "
            "Options().autotune.ram_budget"
        )

    def _batch(self, task: _Task) -> Any:
        msg = task.result
        if msg[0] == "error":
            _, _, stage, pos, exc, tb = msg
            from stratagem.data.parallel import _RemoteTraceback

            exc.__cause__ = _RemoteTraceback(tb)
            self.close()
            if stage is None:  # collate failed (e.g. shapes that do not stack)
                raise exc
            st = self.stages[stage]
            raise failure(st.name, st.fn, pos, exc) from exc
        if task.error_after is not None:
            self.close()
            raise task.error_after
        if not task.collate:
            return None
        w = task.worker
        assert w is not None
        skel, descs = msg[4]
        arena_id = msg[2]
        arena = w.outputs[arena_id]
        if not self.batch_bytes:
            self.batch_bytes = sum(
                d[1].itemsize * max(1, _numel(d[2])) for d in descs if d[0] == "T"
            )
        w.handed_out(arena_id)
        return sharedmem.read_batch(skel, descs, arena, functools.partial(w.on_release, arena_id))

    def __next__(self) -> Any:
        with self.lock:
            if self.closed:
                raise StopIteration
        try:
            self._fill()
            pending = [t for t in self.tasks if not t.returned]
            if not pending:
                self._finish()
                raise StopIteration
            task = self._wait(pending[:1] if self.in_order else pending)
            task.returned = True
            while self.tasks and self.tasks[0].returned:
                self.tasks.popleft()
            value = self._batch(task)
            if value is None:  # a remainder dropped by drop_remainder
                self._finish()
                raise StopIteration
            self._fill()  # start the next batches before handing this one out
            return value
        except (StopIteration, PipelineClosed, WorkerDiedError):
            raise
        except Exception:
            if self.closed:
                raise
            self.close()
            raise

    def _finish(self) -> None:
        """End of input, every result received: no worker touches an arena any more, so
        they go to the pool now; the processes are joined on a thread (their exit takes tens
        of milliseconds: the kernel unmaps what they inherited), not on the consumer's time.

        Not a daemon thread: it drops the last references to the workers' arenas, whose tensors'
        deleters take the GIL. A daemon thread doing that while the interpreter finalizes (a
        script that ends right after its last batch) aborts the process ("terminate called
        without an active exception"); a thread that is not a daemon is joined before that."""
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                _send(w.conn, ("stop",))
            except OSError:
                pass
            w.stop()
        if workers:
            threading.Thread(target=_reap, args=(workers,), name="stratagem-reaper",
                             daemon=False).start()

    # -- state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        pending = [t for t in self.tasks if not t.returned]
        if pending and pending[0].positions:
            base = pending[0]
            first = base.positions[0]
            skip = set(self.skip)
            for t in self.tasks:
                skip.update(p for p in t.skipped if p > first)
                if t.returned:
                    skip.update(p for p in t.positions if p > first)
            state: dict[str, Any] = {"input": base.snap, "pos": first, "skip": sorted(skip)}
            qs = base.qs
        elif pending:  # only an input error is pending: the input's state before it
            state = {"input": pending[0].snap, "pos": self.pos, "skip": sorted(self.skip)}
            qs = pending[0].qs
        else:
            state = {"input": self.child.state_dict(), "pos": self.pos,
                     "skip": sorted(self.skip)}
            qs = self.q
        for q in qs:
            state = {"input": state, "pos": q}
        return {"input": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = state["input"]
        qs = []
        for _ in self.seg.steps:
            qs.append(int(s["pos"]))
            s = s["input"]
        self.q = list(reversed(qs))
        self.child.load_state_dict(s["input"])
        self.pos = int(s["pos"])
        self.skip = {int(p) for p in s["skip"]}

    # -- shutdown ------------------------------------------------------------------
    def _stop_workers(self) -> None:
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                _send(w.conn, ("stop",))
            except OSError:
                pass
        _reap(workers)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self._stop_workers()
        self.child.close()


def _reap(workers: list[_Worker]) -> None:
    """Join stopped workers (terminate, then kill, the ones that do not end); their free
    arenas go to the pool once they can no longer write into them."""
    for w in workers:
        w.proc.join(0.5)
        if w.proc.is_alive():
            w.proc.terminate()
            w.proc.join(2.0)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(2.0)
        w.conn.close()
        if not w.proc.is_alive():
            w.stop()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
