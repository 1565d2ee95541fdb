"""Background iteration: a thread that runs an iterator ahead into a bounded buffer (prefetch)."""

from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from typing import Any

from stratagem.data.autotune import Tuner
from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import AUTOTUNE, Options
from stratagem.data.structure import nbytes

_ELEM, _END, _ERR = 0, 1, 2


class PipelineClosed(Exception):
    """Raised inside a pipeline's threads when it is being shut down."""


_running: weakref.WeakSet[BackgroundIterator] = weakref.WeakSet()


@atexit.register
def _stop_all(timeout: float = 2.0) -> None:
    """At interpreter exit, stop the pipeline threads still running: a daemon thread inside
    a torch op while the interpreter and torch's statics are torn down can abort the
    process."""
    its = list(_running)
    for it in its:
        with it.cv:
            it.stopped = True
            it.cv.notify_all()
    deadline = time.monotonic() + timeout
    for it in its:
        if it.thread is not None and it.thread is not threading.current_thread():
            it.thread.join(max(0.0, deadline - time.monotonic()))


class BackgroundIterator(StatefulIterator):
    """Runs ``child`` on a thread, buffering up to ``buffer_size`` elements (or AUTOTUNE).

    Each buffered element carries the child's state from just before it was produced, so
    ``state_dict()`` is the state before the oldest element not yet handed out: a restore
    replays exactly the elements that were buffered but never consumed.
    """

    def __init__(
        self, child: StatefulIterator, buffer_size: int, options: Options, name: str = "prefetch"
    ) -> None:
        self.children = [child]
        self.child = child
        self.tuner = Tuner(1, options.resolved_ram_budget)
        self.autotune = buffer_size == AUTOTUNE
        self.fixed = max(1, int(buffer_size)) if not self.autotune else 0
        self.name = name
        self.lock = threading.Lock()  # held while touching the child
        self.cv = threading.Condition()
        self.queue: collections.deque[tuple[int, Any, Any]] = collections.deque()
        self.thread: threading.Thread | None = None
        self.stopped = False

    def _limit(self) -> int:
        return self.tuner.buffer_size() if self.autotune else self.fixed

    def start(self) -> None:
        if self.thread is None and not self.stopped:
            self.thread = threading.Thread(
                target=self._produce, name=f"stratagem-{self.name}", daemon=True
            )
            self.thread.start()
            _running.add(self)

    def _produce(self) -> None:
        while True:
            with self.cv:
                while len(self.queue) >= self._limit() and not self.stopped:
                    self.cv.wait(0.1)
                if self.stopped:
                    return
            with self.lock:
                if self.stopped:
                    return
                snap = self.child.state_dict()
                kind: int
                try:
                    value: Any = next(self.child)
                    kind = _ELEM
                    if self.autotune:
                        self.tuner.element_bytes.add(nbytes(value))
                except StopIteration:
                    kind, value = _END, None
                except PipelineClosed:
                    return
                except BaseException as e:  # noqa: BLE001 - handed to the consumer
                    kind, value = _ERR, e
                with self.cv:
                    self.queue.append((kind, snap, value))
                    self.cv.notify_all()
            if kind != _ELEM:
                return

    def ready(self) -> bool:
        """Whether ``next`` would return without waiting."""
        return bool(self.queue)

    def __next__(self) -> Any:
        self.start()
        waited = False
        with self.cv:
            while not self.queue:
                if self.stopped:
                    raise PipelineClosed(f"{self.name} was closed")
                if self.thread is not None and not self.thread.is_alive() and not self.queue:
                    raise RuntimeError(f"{self.name} thread ended without a result")
                waited = True
                self.cv.wait(0.1)
            kind, _, value = self.queue[0]
            if kind == _ELEM:
                self.queue.popleft()
                self.cv.notify_all()
        if waited and self.autotune:
            self.tuner.starved()
        if kind == _END:
            raise StopIteration
        if kind == _ERR:
            raise value
        return value

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            with self.cv:
                if self.queue:
                    return {"input": self.queue[0][1]}
            return {"input": self.child.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])

    def close(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
        self.child.close()
        if self.thread is not None and self.thread is not threading.current_thread():
            deadline = time.monotonic() + 30
            while self.thread.is_alive() and time.monotonic() < deadline:
                self.thread.join(0.1)
                self.child.close()


class PrefetchDataset(Dataset):
    """Runs the input ahead on a background thread, ``buffer_size`` elements (or AUTOTUNE)."""

    def __init__(self, input_ds: Dataset, buffer_size: int) -> None:
        if buffer_size != AUTOTUNE and int(buffer_size) < 0:
            raise ValueError(f"prefetch: buffer_size must be >= 0 or AUTOTUNE, got {buffer_size}")
        self._inputs = (input_ds,)
        self._buffer_size = int(buffer_size)

    def _cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        child = self._inputs[0]._make_iterator(ctx.child(0))
        if self._buffer_size == 0:
            return child
        return BackgroundIterator(child, self._buffer_size, ctx.options)
