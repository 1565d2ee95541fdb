"""ClusterCoordinator (tf.distribute.coordinator): schedule functions onto workers, get RemoteValues.

One thread per worker takes the next scheduled function from one queue, ships it (pickled by
value, with handles for variables, optimizers, the strategy and per-worker iterators) and runs
it there. A worker that cannot be reached has its function put back at the head of the queue
for the others, and takes no more until it is restarted and rejoins (its thread waits for that);
every function's result is delivered exactly once. The rpc group's members change (a lost worker
taken out, a restarted one admitted) only while the cluster is quiet (``_quiet``). An error
raised by a function is kept in its RemoteValue, and the first one is raised by the next
``schedule``, ``join`` or ``done``, which first cancels the functions still queued (their
RemoteValues raise ``CancelledError``) and waits for those under way, then forgets it: later
calls do not raise it again (tf's rules). A parameter server that is lost ends training with
that error. A metric (``stratagem.metrics.Metric``) a function captures is updated on the
worker in a copy; what the function added comes back with its result and is added to the
chief's metric at the next ``schedule``, ``join``, ``done`` or ``fetch`` on the chief's thread
(tf keeps such a metric in variables on the ps tasks), once per function that ran.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from stratagem.core import tree
from stratagem.distribute.engines import rpc_membership
from stratagem.distribute.engines.parameter_server import ParameterServerExtended, TaskLostError
from stratagem.distribute.engines.ps_client import ParameterServerError, rebuilt_error
from stratagem.distribute.engines.ps_pickle import dumps

__all__ = [
    "CancelledError",
    "ClusterCoordinator",
    "OutOfRangeError",
    "PerWorkerValues",
    "RemoteValue",
    "WorkerLostError",
]


class OutOfRangeError(Exception):
    """A per-worker iterator ran out inside a scheduled function (tf.errors.OutOfRangeError)."""


class WorkerLostError(RuntimeError):
    """No worker is left to run the scheduled functions."""


class CancelledError(RuntimeError):
    """A scheduled function that never ran: an earlier one failed, and when that error was
    raised the functions still queued were cancelled (tf.errors.CancelledError). Schedule it again."""


class RemoteValue:
    """The result of a scheduled function, set once when a worker has run it."""

    def __init__(self, settle: Callable[[], None] | None = None) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._settle = settle  # the coordinator's: add the finished functions' metric updates

    def _set(self, value: Any) -> bool:
        if self._done.is_set():
            return False
        self._value = value
        self._done.set()
        return True

    def _fail(self, error: BaseException) -> bool:
        if self._done.is_set():
            return False
        self._error = error
        self._done.set()
        return True

    def done(self) -> bool:
        return self._done.is_set()

    def fetch(self) -> Any:
        """Wait for the function; its return value, or the error it raised."""
        self._done.wait()
        if self._settle is not None:
            self._settle()
        if self._error is not None:
            raise self._error
        return self._value

    def get(self) -> Any:
        """The same as :meth:`fetch` (tf's ``get`` keeps tensors as tensors; so does fetch here)."""
        return self.fetch()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error is not None else "done")
        return f"RemoteValue({state})"


class PerWorkerValues:
    """One value per worker (tf.distribute.experimental.coordinator.PerWorkerValues)."""

    def __init__(self, values: tuple[Any, ...]) -> None:
        self._values = values

    def __repr__(self) -> str:
        return f"PerWorkerValues({len(self._values)} workers)"


class PerWorkerDataset:
    """A dataset each worker builds for itself from ``dataset_fn``; ``iter()`` gives a
    PerWorkerIterator to pass to scheduled functions, where it is that worker's iterator."""

    def __init__(self, coordinator: ClusterCoordinator, dataset_fn: Callable[..., Any], key: str) -> None:
        self._coordinator = weakref.ref(coordinator)
        self.dataset_fn = dataset_fn
        self.key = key
        self._fn_bytes: bytes | None = None
        self._iterators = itertools.count()

    def fn_bytes(self, handle_of: Callable[[Any], Any]) -> bytes:
        if self._fn_bytes is None:
            self._fn_bytes = dumps(self.dataset_fn, handle_of)
        return self._fn_bytes

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self, f"{self.key}/{next(self._iterators)}")

    def __repr__(self) -> str:
        return f"PerWorkerDataset({self.key})"


class PerWorkerIterator:
    """One iterator per worker over its own copy of a PerWorkerDataset."""

    def __init__(self, dataset: PerWorkerDataset, key: str) -> None:
        self.dataset = dataset
        self.key = key

    def __next__(self) -> Any:
        raise TypeError(
            "a per-worker iterator is read inside a scheduled function: pass it to "
            "coordinator.schedule(step_fn, args=(iterator,)) and call next() there"
        )

    def __repr__(self) -> str:
        return f"PerWorkerIterator({self.key})"


class _Closure:
    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], settle: Callable[[], None]
    ) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.value = RemoteValue(settle)


def _rebuild_error(name: str, message: str, where: str, remote_tb: str) -> BaseException:
    if name == "StopIteration":
        return OutOfRangeError(f"{where}: {message}")
    if name == "ParameterServerError":
        return ParameterServerError(message)
    return rebuilt_error(name, message, f"the scheduled function on {where}", where, remote_tb)


class ClusterCoordinator:
    """Schedules functions onto the workers of a ParameterServerStrategy (on the chief).

    One per strategy, as in tf: ``ClusterCoordinator(strategy)`` again (``fit`` does) returns the
    same coordinator while it is open."""

    def __new__(cls, strategy: Any, **kwargs: Any) -> ClusterCoordinator:
        ext = getattr(strategy, "extended", None)
        existing = getattr(ext, "coordinator", None)
        if isinstance(existing, cls) and not existing._closed:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: Any, *, function_timeout: float = 600.0) -> None:
        if getattr(self, "_started", False):
            return  # the strategy's open coordinator, returned by __new__
        ext = getattr(strategy, "extended", None)
        if not isinstance(ext, ParameterServerExtended):
            raise TypeError(f"ClusterCoordinator needs a ParameterServerStrategy, got {type(strategy).__name__}")
        if not ext.spec.is_chief:
            raise RuntimeError("ClusterCoordinator runs on the chief task only")
        self.strategy = strategy
        self._ext = ext
        self._timeout = function_timeout
        self._queue: collections.deque[_Closure] = collections.deque()
        self._cond = threading.Condition()
        self._inflight = 0
        self._changing = 0  # threads changing the rpc group's members (_quiet): no function starts
        self._held = 0  # of those, the ones whose own function is still counted in _inflight
        self._error: BaseException | None = None
        self._error_of: RemoteValue | None = None  # the function whose error _error is
        self._running: set[_Closure] = set()
        self._metric_updates: list[tuple[Any, Any]] = []  # (the chief's metric, totals a worker added)
        self._fatal: BaseException | None = None
        self._closed = False
        self._live = set(ext.worker_names)
        self._all_lost_at: float | None = None  # when the last live worker was lost (restarts expected)
        self._sent: dict[str, set[str]] = {w: set() for w in ext.worker_names}
        self._configured: dict[str, int] = {}
        self.lost_workers: list[str] = []
        self._threads = [
            threading.Thread(target=self._work, args=(w,), name=f"coordinator-{w}", daemon=True)
            for w in ext.worker_names
        ]
        ext.coordinator = self
        self._started = True
        for t in self._threads:
            t.start()

    # --- the public API ----------------------------------------------------------------------
    def schedule(self, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on the next free worker; returns its RemoteValue."""
        self._raise_pending()
        closure = _Closure(fn, tuple(args), dict(kwargs or {}), self._settle)
        with self._cond:
            self._queue.append(closure)
            self._cond.notify_all()
        return closure.value

    def join(self) -> None:
        """Wait until every scheduled function has run; raise the first error one raised (then
        the functions still queued are cancelled, and the error is not raised again)."""
        with self._cond:
            while (
                (self._queue or self._inflight)
                and self._error is None  # tf: an error ends the wait; the rest is cancelled
                and self._fatal is None
                and (self._live or self._all_lost_at is not None)
            ):
                self._cond.wait(1.0)
        self._raise_pending()

    def done(self) -> bool:
        """Whether every scheduled function has run (raises the first error, as join)."""
        with self._cond:
            busy = bool(self._queue or self._inflight)
        self._raise_pending()
        return not busy

    def fetch(self, value: Any) -> Any:
        """``value`` with every RemoteValue in it replaced by its result (waiting for each)."""
        self._settle()
        return tree.map_structure(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, value, is_leaf=lambda v: isinstance(v, RemoteValue))

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any]) -> PerWorkerDataset:
        """A dataset every worker builds by calling ``dataset_fn()`` (or ``dataset_fn(input_context)``)."""
        if isinstance(dataset_fn, PerWorkerValues):
            raise TypeError("create_per_worker_dataset takes a function that builds the dataset on each worker")
        if not callable(dataset_fn):
            raise TypeError(
                f"create_per_worker_dataset takes a function returning a dataset, got {type(dataset_fn).__name__}: "
                "wrap it, e.g. `lambda: dataset`"
            )
        # numbered per strategy: a worker keeps every dataset it built under its key
        return PerWorkerDataset(self, dataset_fn, f"d{next(self._ext.dataset_keys)}")

    def close(self) -> None:
        """Take no more functions; the worker threads end after the one they run."""
        with self._cond:
            self._closed = True
            for c in self._queue:
                c.value._fail(RuntimeError("the coordinator was closed before this function ran"))
            self._queue.clear()
            self._cond.notify_all()

    def shutdown(self) -> None:
        """Close, and let the other tasks leave (done at the chief's exit anyway)."""
        self.close()
        self._ext.shutdown()

    # --- what handles mean here ----------------------------------------------------------------
    def handle(self, o: Any, worker: str) -> tuple[Any, ...] | None:
        if isinstance(o, PerWorkerIterator):
            ds = o.dataset
            first = ds.key not in self._sent[worker]
            fn = ds.fn_bytes(self._ext.handle_of(self, worker)) if first else None
            self._sent[worker].add(ds.key)
            return ("iterator", o.key, ds.key, fn)
        if isinstance(o, PerWorkerDataset):
            first = o.key not in self._sent[worker]
            fn = o.fn_bytes(self._ext.handle_of(self, worker)) if first else None
            self._sent[worker].add(o.key)
            return ("dataset", o.key, fn)
        if isinstance(o, ClusterCoordinator):
            raise TypeError("a scheduled function cannot use the ClusterCoordinator (it lives on the chief)")
        return None

    # --- errors, cancellation and metric updates (on the caller's thread) ----------------------
    def _raise_pending(self) -> None:
        """Raise the first error a function raised since the last one was raised, once: the
        functions still queued are cancelled and those under way waited for first (tf's
        ``_raise_if_error``); the metric updates of those that ran are added before."""
        err: BaseException | None = None
        with self._cond:
            if self._fatal is None and self._error is not None:
                self._cancel(lambda c: True, self._error)
                err, self._error, self._error_of = self._error, None, None
            fatal = self._fatal
        self._settle()
        if fatal is not None:
            raise fatal
        if err is not None:
            raise err

    def _cancel(self, which: Callable[[_Closure], bool], cause: BaseException | None) -> None:
        """Cancel the queued functions ``which`` picks and wait for those of them under way
        (the caller holds the lock)."""
        while True:
            keep: collections.deque[_Closure] = collections.deque()
            for c in self._queue:
                if which(c):
                    c.value._fail(
                        CancelledError(
                            "The corresponding function is cancelled. Please reschedule the function."
                            + (f" (an earlier scheduled function failed: {type(cause).__name__}: {cause})" if cause else "")
                        )
                    )
                else:
                    keep.append(c)
            self._queue = keep
            busy = [c for c in self._running if which(c)]
            if not busy or self._fatal is not None or (not self._live and self._all_lost_at is None):
                break
            self._cond.wait(1.0)  # a function under way may come back to the queue (its worker lost)
        self._cond.notify_all()

    def _abandon(self, values: Any) -> None:
        """The caller gives up on the functions whose RemoteValues are ``values`` (a ``fit`` that
        failed): those still queued are cancelled, those under way waited for, and the first
        error, if one of them raised it, is forgotten: it was the caller's, raised already."""
        mine = {id(v) for v in values}
        with self._cond:
            self._cancel(lambda c: id(c.value) in mine, None)
            if self._error_of is not None and id(self._error_of) in mine:
                self._error, self._error_of = None, None
        self._settle()

    def _settle(self) -> None:
        """Add the metric updates that came back with finished functions to the chief's metrics."""
        with self._cond:
            updates, self._metric_updates = self._metric_updates, []
        for metric, totals in updates:
            metric.add_totals(totals)

    # --- the worker threads --------------------------------------------------------------------
    def _next(self, worker: str) -> _Closure | _Lost | str | None:
        """The next function for ``worker``; None when the coordinator is done; a rejoin request's
        id when the worker restarted while it waited for work."""
        with self._cond:
            while (not self._queue or self._changing) and not self._closed and self._fatal is None:
                if worker in self._ext.failed:
                    return _Lost(self._ext.failed[worker])
                self._cond.wait(1.0)
                if not self._queue and (request := self._ext.rejoin_request(worker)) is not None:
                    return request
            if self._closed or self._fatal is not None:
                return None
            if worker in self._ext.failed:
                return _Lost(self._ext.failed[worker])
            self._inflight += 1
            closure = self._queue.popleft()
            self._running.add(closure)
            return closure

    def _finish(self, closure: _Closure | None, error: BaseException | None = None, requeue: bool = False) -> None:
        with self._cond:
            self._inflight -= 1
            self._running.discard(closure)  # type: ignore[arg-type]
            if requeue and closure is not None:
                if self._fatal is not None:  # nothing runs any more: it gets the error that says why
                    closure.value._fail(self._fatal)
                elif self._error is not None:  # tf: a function put back after an error is cancelled
                    closure.value._fail(
                        CancelledError("The corresponding function is cancelled. Please reschedule the function.")
                    )
                else:
                    self._queue.appendleft(closure)
            if error is not None and self._error is None and closure is not None:
                self._error, self._error_of = error, closure.value
            self._cond.notify_all()

    def _work(self, worker: str) -> None:
        ext = self._ext
        while True:
            closure = self._next(worker)
            if closure is None:
                return
            if isinstance(closure, str):  # it died while idle and is back: the old process is gone
                self._lost(worker, RuntimeError("it restarted"), force=True, holding=False)
                if not self._await_return(worker, closure):
                    return
                continue
            if isinstance(closure, _Lost):  # the watch found it lost while it waited for work
                self._lost(worker, TaskLostError(closure.why), force=True, holding=False)
                if not self._await_return(worker):
                    return
                continue
            try:
                if self._configured.get(worker) != len(ext.plans):
                    ext.configure_worker(worker)
                    self._configured[worker] = len(ext.plans)
                optimizers: list[Any] = []
                metrics: list[Any] = []
                payload = dumps((closure.fn, closure.args, closure.kwargs), ext.handle_of(self, worker, optimizers, metrics))
            except Exception as e:
                if self._lost(worker, e):
                    self._finish(closure, requeue=True)
                    if not self._await_return(worker):
                        return
                    continue
                shipped = TypeError(f"could not ship the scheduled function {getattr(closure.fn, '__name__', closure.fn)!r} to {worker}: {e}")
                closure.value._fail(shipped)
                self._finish(closure, shipped)
                continue
            try:
                status, value, *updates = ext.run_on(worker, payload, self._timeout)
            except ParameterServerError as e:  # a ps task is lost (the watch): training cannot go on
                with self._cond:
                    self._fail_all(e)
                closure.value._fail(e)
                self._finish(closure, e)
                return
            except Exception as e:
                self._lost(worker, e, force=True)
                self._finish(closure, requeue=True)
                if not self._await_return(worker):
                    return
                continue
            if status == "gone":  # the worker is leaving (the chief is shutting down)
                self._finish(closure, requeue=True)
                return
            ext.functions_done += 1  # the chief's copies of the variables may be stale now
            ext.stepped(optimizers)
            if status == "ok":
                if updates and updates[0]:
                    with self._cond:  # added on the caller's thread (_settle), before it sees the result
                        self._metric_updates.extend((metrics[i], totals) for i, totals in updates[0])
                closure.value._set(value)
                self._finish(closure)
                continue
            name, message, remote_tb = value
            err = _rebuild_error(name, message, worker, remote_tb)
            if isinstance(err, ParameterServerError):
                last = ext.last_checkpoint
                err = ParameterServerError(
                    f"{err} ({f'the last checkpoint this job saved: {last}' if last else 'this job saved no checkpoint'})"
                )
                with self._cond:
                    self._fatal = self._fatal or err
                    for c in self._queue:  # nothing more can run: each waiting value gets the error
                        c.value._fail(self._fatal)
                    self._queue.clear()
                    self._cond.notify_all()
            closure.value._fail(err)
            self._finish(closure, err)

    def _lost(self, worker: str, e: BaseException, force: bool = False, holding: bool = True) -> bool:
        """``worker`` cannot be reached (``force``: its call failed in transport): it takes no more
        functions; its function (``holding``: one is under way) goes back to the queue for the
        others."""
        if not force:
            try:
                import torch.distributed.rpc as rpc

                rpc.rpc_sync(worker, _noop, timeout=5)
                return False
            except Exception:
                pass
        first = (str(e).splitlines()[0] if str(e) else type(e).__name__).split(" (this error originated")[0]
        sys.stderr.write(
            f"stratagem: {worker} failed ({first}); its functions run on the other workers\n"
        )
        sys.stderr.flush()
        self._evict(worker, holding)
        with self._cond:
            self._live.discard(worker)
            self.lost_workers.append(worker)
            if not self._live:
                if self._ext.worker_restarts > 0:  # the launcher restarts workers: wait for one, bounded
                    self._all_lost_at = time.monotonic()
                    sys.stderr.write(
                        f"stratagem: every worker is lost; waiting up to {self._ext.timeout:g}s for one to be restarted\n"
                    )
                    sys.stderr.flush()
                else:
                    self._fail_all(
                        WorkerLostError(
                            f"every worker is lost ({', '.join(self.lost_workers)}); the scheduled functions "
                            "cannot run: restart the job and restore the last checkpoint"
                        )
                    )
            self._cond.notify_all()
        return True

    def _evict(self, worker: str, holding: bool) -> None:
        """Take the lost ``worker`` out of the rpc group (so that a restarted process can join it)."""
        with self._quiet(holding):
            self._ext.evict(worker)

    @contextlib.contextmanager
    def _quiet(self, holding: bool) -> Iterator[None]:
        """The cluster quiet for a change of the rpc group's members (a lost worker taken out, a
        restarted one admitted): torch's agents change their member tables without the lock
        their other threads read them under (``rpc_membership``), so a task making or serving a
        call meanwhile can crash. No function starts until the change is done; those under way
        are waited for (at most 30 s; ``holding``: the caller's own, which ends after it, is not
        waited for); the chief's own calls wait (``rpc_membership.LOCK``, taken here last: a
        change waits for a read of the ps tasks on the chief, never the other way round)."""
        with self._cond:
            self._changing += 1
            self._held += int(holding)
            deadline = time.monotonic() + min(30.0, self._ext.timeout)
            while self._inflight > self._held and time.monotonic() < deadline and self._fatal is None:
                self._cond.wait(0.05)
        try:
            with rpc_membership.LOCK:
                yield
        finally:
            with self._cond:
                self._changing -= 1
                self._held -= int(holding)
                self._cond.notify_all()

    def task_lost(self, task: str) -> None:
        """The cluster watch found ``task`` lost (``ext.failed`` says why): a worker's thread
        takes it out (its function, if one runs, goes to the others); a lost ps task ends
        training (``ext.fatal``)."""
        with self._cond:
            if self._ext.fatal is not None:
                self._fail_all(self._ext.fatal)
            self._cond.notify_all()

    def _fail_all(self, error: BaseException) -> None:
        """Nothing more can run: every waiting function gets ``error``, and so does every one
        under way (its worker's thread may be held for seconds more, taking a lost task out of
        the group: the caller's ``fetch`` does not wait for it). The caller holds the lock."""
        self._fatal = self._fatal or error
        for c in [*self._queue, *self._running]:
            c.value._fail(self._fatal)
        self._queue.clear()
        self._cond.notify_all()

    def _await_return(self, worker: str, request: str | None = None) -> bool:
        """Wait for the lost ``worker`` to be restarted and take it back (its per-worker datasets
        are built again there, as tf does); False when the coordinator is done first."""
        ext = self._ext
        while True:
            with self._cond:
                if self._closed or self._fatal is not None:
                    return False
                if not self._live and self._all_lost_at is not None and time.monotonic() - self._all_lost_at > ext.timeout:
                    self._fail_all(
                        WorkerLostError(
                            f"every worker is lost ({', '.join(sorted(set(self.lost_workers)))}) and none was "
                            f"restarted within {ext.timeout:g}s: restart the job and restore the last checkpoint"
                        )
                    )
                    return False
            request = request or ext.rejoin_request(worker)
            if request is not None:
                with self._quiet(holding=False):
                    back = ext.readmit(worker, request)
                if back:
                    with self._cond:
                        self._configured.pop(worker, None)
                        self._sent[worker] = set()
                        self._live.add(worker)
                        self._all_lost_at = None
                        self._cond.notify_all()
                    sys.stderr.write(f"stratagem: {worker} restarted and rejoined; it runs functions again\n")
                    sys.stderr.flush()
                    return True
                request = None
            with self._cond:
                self._cond.wait(0.5)


class _Lost:
    """What ``_next`` gives a worker's thread whose worker the watch found lost."""

    def __init__(self, why: str) -> None:
        self.why = why


def _noop() -> None:
    return None
