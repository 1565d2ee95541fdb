"""Parallel map on a thread pool or a spawn-context process pool, resumable and in tf order."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import multiprocessing
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stratagem.data.autotune import Tuner
from stratagem.data.dataset import Dataset
from stratagem.data.functions import call, element_rng, failure, function_name
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import AUTOTUNE
from stratagem.data.structure import flatten, map_structure, nbytes, pack_as


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
        use_processes: bool,
        name: str | None,
    ) -> None:
        if num_parallel_calls != AUTOTUNE and int(num_parallel_calls) < 1:
            raise ValueError(
                f"map: num_parallel_calls must be >= 1 or AUTOTUNE, got {num_parallel_calls}"
            )
        if use_processes:
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

    def _cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _ParallelMapIterator(self, ctx)


def _timed_call(fn: Callable[..., Any], element: Any, seed: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    rng = element_rng(seed) if seed is not None else None
    return call(fn, element, rng), time.perf_counter() - start


def _process_call(fn: Callable[..., Any], element: Any, seed: Any) -> tuple[Any, list, list, float]:
    """Runs in a worker process; numpy leaves travel back as shared-memory tensors."""
    element = _restore_shared(*element)
    out, seconds = _timed_call(fn, element, seed)
    return (*_to_shared(out), seconds)


def _to_shared(element: Any) -> tuple[Any, list[Any], list[str]]:
    """(skeleton, leaves, kinds): array leaves become tensors, which torch's pickler moves to
    shared memory instead of copying their bytes through the pipe."""
    leaves, kinds = [], []
    for leaf in flatten(element):
        if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biuf" and leaf.dtype != np.uint16:
            leaves.append(torch.from_numpy(np.ascontiguousarray(leaf)))
            kinds.append("numpy")
        else:
            leaves.append(leaf)
            kinds.append("")
    return map_structure(lambda _: None, element), leaves, kinds


def _restore_shared(skeleton: Any, leaves: list[Any], kinds: list[str]) -> Any:
    restored = [x.numpy() if k == "numpy" else x for x, k in zip(leaves, kinds)]
    return pack_as(skeleton, restored)


class _Entry:
    __slots__ = ("pos", "snap", "future", "yielded")

    def __init__(self, pos: int, snap: Any, future: cf.Future | None, yielded: bool) -> None:
        self.pos, self.snap, self.future, self.yielded = pos, snap, future, yielded


class _ParallelMapIterator(StatefulIterator):
    """Keeps up to p elements in flight; state = input state before the oldest element not
    yet returned, plus the positions after it already returned (deterministic=False)."""

    def __init__(self, ds: ParallelMapDataset, ctx: Context) -> None:
        self.ds, self.ctx = ds, ctx
        self.child = ds._inputs[0]._make_iterator(ctx.child(0))
        self.children = [self.child]
        options = ctx.options
        self.deterministic = (
            options.resolved_deterministic if ds._deterministic is None else ds._deterministic
        )
        cap = options.resolved_cpu_budget
        if ds._use_processes:
            cap = min(cap, multiprocessing.cpu_count())
        self.max_workers = cap if ds._n == AUTOTUNE else ds._n
        self.tuner = Tuner(self.max_workers, options.resolved_ram_budget)
        self.pool: cf.Executor | None = None
        self.inflight: collections.deque[_Entry] = collections.deque()
        self.pos = 0
        self.skip: set[int] = set()
        self.input_done = False
        self.last_return: float | None = None
        self.closed = False

    # -- execution -------------------------------------------------------------------
    def _pool(self) -> cf.Executor:
        if self.pool is None:
            if self.ds._use_processes:
                self.pool = cf.ProcessPoolExecutor(
                    self.max_workers, mp_context=multiprocessing.get_context("spawn")
                )
            else:
                self.pool = cf.ThreadPoolExecutor(
                    self.max_workers, thread_name_prefix="stratagem-map"
                )
        return self.pool

    def _submit(self, x: Any, pos: int) -> cf.Future:
        seed = self.ctx.seed_sequence(self.ds._seed, pos) if self.ds._with_rng else None
        if self.ds._use_processes:
            return self._pool().submit(_process_call, self.ds._fn, _to_shared(x), seed)
        return self._pool().submit(_timed_call, self.ds._fn, x, seed)

    def _target(self) -> int:
        p = self.tuner.parallelism() if self.ds._n == AUTOTUNE else self.max_workers
        # processes: keep a second element queued per worker to hide the pipe round trip
        return 2 * p if self.ds._use_processes else p

    def _fill(self) -> None:
        target = self._target()
        while not self.input_done and sum(not e.yielded for e in self.inflight) < target:
            snap = self.child.state_dict()
            try:
                x = next(self.child)
            except StopIteration:
                self.input_done = True
                break
            pos = self.pos
            self.pos += 1
            if pos in self.skip:
                self.skip.discard(pos)
                self.inflight.append(_Entry(pos, snap, None, True))
            else:
                self.inflight.append(_Entry(pos, snap, self._submit(x, pos), False))

    def _purge(self) -> None:
        while self.inflight and self.inflight[0].yielded:
            self.inflight.popleft()

    def __next__(self) -> Any:
        if self.closed:
            raise StopIteration
        if self.last_return is not None:
            self.tuner.consume.add(time.perf_counter() - self.last_return)
        self._purge()
        self._fill()
        pending = [e for e in self.inflight if not e.yielded]
        if not pending:
            raise StopIteration
        if self.deterministic:
            entry = pending[0]
        else:
            futures: dict[Any, _Entry] = {e.future: e for e in pending}
            done, _ = cf.wait(list(futures), return_when=cf.FIRST_COMPLETED)
            entry = min((futures[f] for f in done), key=lambda e: e.pos)
        assert entry.future is not None
        try:
            result = entry.future.result()
        except Exception as e:
            self.close()
            raise failure(self.ds._name, self.ds._fn, entry.pos, e) from e
        entry.yielded, entry.future = True, None
        self._purge()
        if self.ds._use_processes:
            skeleton, leaves, kinds, seconds = result
            value = _restore_shared(skeleton, leaves, kinds)
        else:
            value, seconds = result
        self.tuner.produce.add(seconds)
        if self.ds._n == AUTOTUNE and self.tuner.element_bytes.count < 16:
            self.tuner.element_bytes.add(nbytes(value))
        self._fill()  # start the next elements before handing this one out
        self.last_return = time.perf_counter()
        return value

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        pending = [e for e in self.inflight if not e.yielded]
        if pending:
            base = pending[0]
            done = {e.pos for e in self.inflight if e.yielded and e.pos > base.pos} | self.skip
            return {"input": base.snap, "pos": base.pos, "skip": sorted(done)}
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
        self.child.close()
