"""Windows and keyed groups: window, group_by_window (and bucket_by_sequence_length over it).

Both keep recent input elements in memory. Their iterator state names the input state before
the oldest element still held plus the positions held; a restore re-reads that span of the
input (as shuffle does), so resume is exact without storing elements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from stratagem.data.dataset import Dataset
from stratagem.data.functions import call_checked, function_name
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from stratagem.data.structure import flatten, pack_as


class Tape:
    """Reads an input iterator by position and remembers the input state before each element
    still needed, so a state can restart the input at the oldest one and re-read the rest."""

    def __init__(self, child: StatefulIterator) -> None:
        self.child = child
        self.pos = 0
        self.snaps: dict[int, Any] = {}

    def pull(self) -> tuple[int, Any]:
        """(position, element); StopIteration at the end of the input."""
        snap = self.child.state_dict()
        x = next(self.child)
        self.snaps[self.pos] = snap
        self.pos += 1
        return self.pos - 1, x

    def release(self, positions: Iterable[int]) -> None:
        for p in positions:
            self.snaps.pop(p, None)

    def state(self, live: Iterable[int]) -> dict[str, Any]:
        live = list(live)
        if live:
            base = min(live)
            return {"input": self.snaps[base], "base": base, "pos": self.pos}
        return {"input": self.child.state_dict(), "base": self.pos, "pos": self.pos}

    def restore(self, state: dict[str, Any], wanted: Iterable[int]) -> dict[int, Any]:
        """Reload the input at the state's base and re-read up to its position, returning
        the elements at the ``wanted`` positions."""
        wanted = set(wanted)
        self.child.load_state_dict(state["input"])
        self.pos, self.snaps = int(state["base"]), {}
        got = {}
        while self.pos < int(state["pos"]):
            p, x = self.pull()
            if p in wanted:
                got[p] = x
            else:
                self.release([p])
        return got


class ListDataset(Dataset):
    """The given elements, in order (a window's or a group's content)."""

    def __init__(self, elements: list[Any]) -> None:
        self._elements = list(elements)

    def _cardinality(self) -> int:
        return len(self._elements)

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        from stratagem.data.sources import _IndexIterator

        return _IndexIterator(len(self._elements), self._elements.__getitem__)


def _window_of(items: list[Any]) -> Any:
    """A window: the elements' structure with each leaf a dataset of that leaf's values."""
    flats = [flatten(x) for x in items]
    return pack_as(items[0], [ListDataset([f[j] for f in flats]) for j in range(len(flats[0]))])


class WindowDataset(Dataset):
    """``window(size, shift, stride, drop_remainder)``: window ``w`` holds input elements
    ``w * shift + k * stride`` for ``k < size``; each is a (structure of) dataset(s)."""

    def __init__(
        self, input_ds: Dataset, size: int, shift: int | None, stride: int, drop_remainder: bool
    ) -> None:
        size, stride = int(size), int(stride)
        shift = size if shift is None else int(shift)
        if size < 1 or shift < 1 or stride < 1:
            raise ValueError(
                f"window: size, shift and stride must be >= 1, got size={size}, shift={shift}, "
                f"stride={stride}"
            )
        self._inputs = (input_ds,)
        self._size, self._shift, self._stride = size, shift, stride
        self._drop = bool(drop_remainder)

    def _cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if n < 0:
            return n
        if not self._drop:
            return -(-n // self._shift)
        span = (self._size - 1) * self._stride + 1
        return 0 if n < span else (n - span) // self._shift + 1

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _WindowIterator(self._inputs[0]._make_iterator(ctx.child(0)), self)


class _WindowIterator(StatefulIterator):
    def __init__(self, child: StatefulIterator, ds: WindowDataset) -> None:
        self.children = [child]
        self.tape, self.ds = Tape(child), ds
        self.w = 0
        self.buf: dict[int, Any] = {}
        self.input_done = False

    def __next__(self) -> Any:
        ds = self.ds
        start = self.w * ds._shift
        needed = [start + k * ds._stride for k in range(ds._size)]
        while not self.input_done and self.tape.pos <= needed[-1]:
            try:
                p, x = self.tape.pull()
            except StopIteration:
                self.input_done = True
                break
            if p >= start:
                self.buf[p] = x
            else:
                self.tape.release([p])
        items = [self.buf[p] for p in needed if p in self.buf]
        if not items or (ds._drop and len(items) < ds._size):
            raise StopIteration
        self.w += 1
        drop = [p for p in self.buf if p < self.w * ds._shift]
        for p in drop:
            del self.buf[p]
        self.tape.release(drop)
        return _window_of(items)

    def state_dict(self) -> dict[str, Any]:
        return {"tape": self.tape.state(self.buf), "held": sorted(self.buf), "w": self.w,
                "input_done": self.input_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buf = self.tape.restore(state["tape"], state["held"])
        self.w, self.input_done = int(state["w"]), bool(state["input_done"])


def _as_key(value: Any, what: str) -> int:
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        if np.ndim(value) != 0:
            raise ValueError(f"{what} must return a scalar integer, got shape {np.shape(value)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{what} must return an integer, got {type(value).__name__}")
    return int(value)


class GroupByWindowDataset(Dataset):
    """``group_by_window``: elements are grouped by ``key_func``; when a group holds its
    window size it becomes ``reduce_func(key, dataset_of_group)`` and that dataset's elements
    are output. When the input ends, the remaining groups are reduced in increasing key order
    (as tf.data does)."""

    def __init__(
        self,
        input_ds: Dataset,
        key_func: Callable[..., Any],
        reduce_func: Callable[[int, Dataset], Dataset],
        window_size: int | None,
        window_size_func: Callable[[int], Any] | None,
    ) -> None:
        if (window_size is None) == (window_size_func is None):
            raise ValueError(
                "group_by_window: give exactly one of window_size and window_size_func"
            )
        if window_size is not None and int(window_size) < 1:
            raise ValueError(f"group_by_window: window_size must be >= 1, got {window_size}")
        self._inputs = (input_ds,)
        self._key_func, self._reduce_func = key_func, reduce_func
        self._window_size, self._window_size_func = window_size, window_size_func

    def _cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        return INFINITE_CARDINALITY if n == INFINITE_CARDINALITY else UNKNOWN_CARDINALITY

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _GroupIterator(self, ctx)

    def window_size_of(self, key: int) -> int:
        if self._window_size is not None:
            return int(self._window_size)
        assert self._window_size_func is not None
        size = _as_key(self._window_size_func(key), "group_by_window: window_size_func")
        if size < 1:
            raise ValueError(f"group_by_window: window_size_func({key}) returned {size}; it "
                             "must be >= 1")
        return size


class _GroupIterator(StatefulIterator):
    def __init__(self, ds: GroupByWindowDataset, ctx: Context) -> None:
        self.ds, self.ctx = ds, ctx
        child = ds._inputs[0]._make_iterator(ctx.child(0))
        self.tape = Tape(child)
        self.buckets: dict[int, list[int]] = {}
        self.elements: dict[int, Any] = {}
        self.group: tuple[int, list[int], int] | None = None  # key, positions, group index
        self.current: StatefulIterator | None = None
        self.groups_started = 0
        self.input_done = False

    @property
    def children(self) -> list[StatefulIterator]:  # type: ignore[override]
        return [self.tape.child] + ([self.current] if self.current is not None else [])

    def _start(self, key: int, positions: list[int], index: int) -> None:
        items = [self.elements.pop(p) for p in positions]
        out = self.ds._reduce_func(key, ListDataset(items))
        if not isinstance(out, Dataset):
            raise TypeError(
                f"group_by_window: reduce_func {function_name(self.ds._reduce_func)} must "
                f"return a Dataset, got {type(out).__name__} for key {key}"
            )
        self.group = (key, positions, index)
        self.current = out._make_iterator(self.ctx.child(1).child(index))

    def __next__(self) -> Any:
        while True:
            if self.current is not None:
                try:
                    return next(self.current)
                except StopIteration:
                    self.current.close()
                    assert self.group is not None
                    self.tape.release(self.group[1])
                    self.current, self.group = None, None
                    continue
            if not self.input_done:
                try:
                    p, x = self.tape.pull()
                except StopIteration:
                    self.input_done = True
                    continue
                key = _as_key(
                    call_checked(self.ds._key_func, x, p, "group_by_window key"),
                    "group_by_window: key_func",
                )
                self.elements[p] = x
                bucket = self.buckets.setdefault(key, [])
                bucket.append(p)
                if len(bucket) >= self.ds.window_size_of(key):
                    del self.buckets[key]
                    self.groups_started += 1
                    self._start(key, bucket, self.groups_started - 1)
                continue
            if self.buckets:
                key = min(self.buckets)
                self.groups_started += 1
                self._start(key, self.buckets.pop(key), self.groups_started - 1)
                continue
            raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        live = [p for b in self.buckets.values() for p in b]
        group = None
        if self.group is not None and self.current is not None:
            key, positions, index = self.group
            live += positions
            group = {"key": key, "positions": positions, "index": index,
                     "state": self.current.state_dict()}
        return {
            "tape": self.tape.state(live),
            "buckets": [[k, b] for k, b in self.buckets.items()],
            "group": group,
            "groups_started": self.groups_started,
            "input_done": self.input_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buckets = {int(k): [int(p) for p in b] for k, b in state["buckets"]}
        group = state["group"]
        wanted = [p for b in buckets.values() for p in b] + (group["positions"] if group else [])
        self.elements = self.tape.restore(state["tape"], wanted)
        self.buckets = buckets
        self.groups_started = int(state["groups_started"])
        self.input_done = bool(state["input_done"])
        if group is not None:
            self._start(int(group["key"]), [int(p) for p in group["positions"]],
                        int(group["index"]))
            assert self.current is not None
            self.current.load_state_dict(group["state"])

    def close(self) -> None:
        for child in self.children:
            child.close()


def bucket_id(length: int, boundaries: list[int]) -> int:
    """The bucket of a sequence length: i such that boundaries[i-1] <= length < boundaries[i]."""
    for i, b in enumerate(boundaries):
        if length < b:
            return i
    return len(boundaries)


def bucket_by_sequence_length(
    dataset: Dataset,
    element_length_func: Callable[..., Any],
    bucket_boundaries: list[int],
    bucket_batch_sizes: list[int],
    padded_shapes: Any = None,
    padding_values: Any = None,
    pad_to_bucket_boundary: bool = False,
    no_padding: bool = False,
    drop_remainder: bool = False,
) -> Dataset:
    """tf.data's bucket_by_sequence_length, built as tf builds it: group_by_window keyed by
    the bucket of ``element_length_func``, each group padded_batch'ed (or batched with
    ``no_padding``) with its bucket's batch size."""
    boundaries = [int(b) for b in bucket_boundaries]
    sizes = [int(b) for b in bucket_batch_sizes]
    if len(sizes) != len(boundaries) + 1:
        raise ValueError(
            f"bucket_by_sequence_length: len(bucket_batch_sizes) must be "
            f"len(bucket_boundaries) + 1 = {len(boundaries) + 1}, got {len(sizes)}"
        )
    if any(b >= c for b, c in zip(boundaries, boundaries[1:])):
        raise ValueError(f"bucket_by_sequence_length: bucket_boundaries must increase, got "
                         f"{boundaries}")

    def key(*args: Any) -> int:
        length = _as_key(element_length_func(*args), "element_length_func")
        return bucket_id(length, boundaries)

    def reduce(bucket: int, group: Dataset) -> Dataset:
        size = sizes[bucket]
        if no_padding:
            return group.batch(size, drop_remainder=drop_remainder)
        shapes = padded_shapes
        if pad_to_bucket_boundary:
            if bucket >= len(boundaries):
                raise ValueError(
                    f"bucket_by_sequence_length: with pad_to_bucket_boundary=True elements "
                    f"must have length < max(bucket_boundaries) = {boundaries[-1]}"
                )
            filler = boundaries[bucket] - 1
            shapes = _fill_unknown(padded_shapes, group, filler)
        return group.padded_batch(size, shapes, padding_values, drop_remainder=drop_remainder)

    return GroupByWindowDataset(
        dataset, key, reduce, None, lambda bucket: sizes[bucket]
    )


def _fill_unknown(padded_shapes: Any, group: Dataset, filler: int) -> Any:
    """padded_shapes with every unknown dimension set to ``filler``. Without padded_shapes,
    the first dimension of every component of rank >= 1 is padded to ``filler`` and the others
    to the longest in the batch (stratagem has no static shapes after a map)."""
    if padded_shapes is not None:
        shapes = flatten(padded_shapes) if isinstance(padded_shapes, tuple | dict) else [
            padded_shapes]
        filled = [[filler if d is None or d == -1 else d for d in
                   ([s] if isinstance(s, int) else list(s))] for s in shapes]
        return pack_as(padded_shapes, filled) if isinstance(padded_shapes, tuple | dict) else (
            filled[0])
    assert isinstance(group, ListDataset)
    first = group._elements[0]
    out = []
    for leaf in flatten(first):
        rank = int(np.ndim(leaf))
        out.append([filler] + [-1] * (rank - 1) if rank else [])
    return pack_as(first, out) if isinstance(first, tuple | dict) else out[0]
