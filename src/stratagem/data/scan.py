"""Running state over elements: scan, take_while, unique, and the reductions reduce and
get_single_element."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stratagem.data.dataset import Dataset
from stratagem.data.functions import MapFunctionError, call_checked, function_name
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from stratagem.data.structure import describe, flatten, from_json, to_json


def _call_with_state(fn: Callable[..., Any], state: Any, x: Any, pos: int, what: str) -> Any:
    """tf.data's (state, element) call: the element is passed whole (a tuple is not unpacked
    into more arguments)."""
    try:
        return fn(state, x)
    except Exception as e:
        err = MapFunctionError(
            f"{what} function failed on element {pos} of {what}({function_name(fn)}): "
            f"{type(e).__name__}: {e}"
        )
        raise err from e


def _check_same_structure(old: Any, new: Any, what: str) -> None:
    if len(flatten(old)) != len(flatten(new)) or type(old) is not type(new) and (
        isinstance(old, tuple | dict) or isinstance(new, tuple | dict)
    ):
        raise ValueError(
            f"{what}: the function returned a state of structure {describe(new)}, but the "
            f"initial state has structure {describe(old)}; return the same structure"
        )


class ScanDataset(Dataset):
    """``scan(initial_state, scan_func)``: ``scan_func(state, element) -> (new_state, output)``.

    The iterator state stores the running state (as JSON values), so resume is exact.
    """

    def __init__(self, input_ds: Dataset, initial_state: Any, fn: Callable[..., Any]) -> None:
        self._inputs = (input_ds,)
        self._initial, self._fn = initial_state, fn

    def _cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _ScanIterator(self._inputs[0]._make_iterator(ctx.child(0)), self)


class _ScanIterator(StatefulIterator):
    def __init__(self, child: StatefulIterator, ds: ScanDataset) -> None:
        self.child, self.children, self.ds = child, [child], ds
        self.state, self.pos = ds._initial, 0

    def __next__(self) -> Any:
        x = next(self.child)
        out = _call_with_state(self.ds._fn, self.state, x, self.pos, "scan")
        if not isinstance(out, tuple) or len(out) != 2:
            raise ValueError(
                f"scan: the function must return (new_state, output_element), got "
                f"{describe(out)} for element {self.pos}"
            )
        _check_same_structure(self.ds._initial, out[0], "scan")
        self.state, self.pos = out[0], self.pos + 1
        return out[1]

    def state_dict(self) -> dict[str, Any]:
        return {"input": self.child.state_dict(), "pos": self.pos, "state": to_json(self.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])
        self.pos, self.state = int(state["pos"]), from_json(state["state"])


class TakeWhileDataset(Dataset):
    """Elements up to (not including) the first for which ``predicate`` is False."""

    def __init__(self, input_ds: Dataset, predicate: Callable[..., Any]) -> None:
        self._inputs = (input_ds,)
        self._predicate = predicate

    def _cardinality(self) -> int:
        return UNKNOWN_CARDINALITY  # as tf.data, even for an infinite input

    def _spec(self) -> Any:
        from stratagem.data.spec import static_spec

        return static_spec(self._inputs[0])

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _TakeWhileIterator(self._inputs[0]._make_iterator(ctx.child(0)), self._predicate)


class _TakeWhileIterator(StatefulIterator):
    def __init__(self, child: StatefulIterator, predicate: Callable[..., Any]) -> None:
        self.child, self.children, self.predicate = child, [child], predicate
        self.pos, self.done = 0, False

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        x = next(self.child)
        self.pos += 1
        if not bool(call_checked(self.predicate, x, self.pos - 1, "take_while")):
            self.done = True
            raise StopIteration
        return x

    def state_dict(self) -> dict[str, Any]:
        return {"input": self.child.state_dict(), "pos": self.pos, "done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])
        self.pos, self.done = int(state["pos"]), bool(state["done"])


def _unique_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor | np.ndarray | np.generic):
        if np.ndim(x) != 0:
            raise TypeError(
                f"unique: elements must be scalars (ints or strings), got {describe(x)}"
            )
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, int | str | bytes):
        raise TypeError(
            f"unique: elements must be integers or strings (as in tf.data), got "
            f"{type(x).__name__}"
        )
    return x


class UniqueDataset(Dataset):
    """Each distinct element once, in order of first appearance (ints or strings)."""

    def __init__(self, input_ds: Dataset) -> None:
        self._inputs = (input_ds,)

    def _cardinality(self) -> int:
        return UNKNOWN_CARDINALITY  # as tf.data, even for an infinite input

    def _spec(self) -> Any:
        from stratagem.data.spec import static_spec

        return static_spec(self._inputs[0])

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _UniqueIterator(self._inputs[0]._make_iterator(ctx.child(0)))


class _UniqueIterator(StatefulIterator):
    """State: the input state and the values seen so far."""

    def __init__(self, child: StatefulIterator) -> None:
        self.child, self.children = child, [child]
        self.seen: set[Any] = set()

    def __next__(self) -> Any:
        while True:
            x = next(self.child)
            key = _unique_key(x)
            if key not in self.seen:
                self.seen.add(key)
                return x

    def state_dict(self) -> dict[str, Any]:
        seen = sorted(self.seen, key=lambda k: (type(k).__name__, k))
        return {"input": self.child.state_dict(), "seen": [to_json(k) for k in seen]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])
        self.seen = {from_json(k) for k in state["seen"]}


def reduce(dataset: Dataset, initial_state: Any, reduce_func: Callable[..., Any]) -> Any:
    """``reduce_func(state, element)`` over every element, from ``initial_state``."""
    if dataset.cardinality() == INFINITE_CARDINALITY:
        raise ValueError("reduce() of an infinite dataset would never end; take(n) first")
    state = initial_state
    with dataset.iterator(epoch=0) as it:
        for pos, x in enumerate(it):
            new = _call_with_state(reduce_func, state, x, pos, "reduce")
            _check_same_structure(initial_state, new, "reduce")
            state = new
    return state


def get_single_element(dataset: Dataset) -> Any:
    """The only element of ``dataset``; a ValueError if it has none or more than one."""
    with dataset.iterator(epoch=0) as it:
        first = next(it, _NONE)
        if first is _NONE:
            raise ValueError("get_single_element: the dataset is empty; it must have exactly "
                             "one element")
        if next(it, _NONE) is not _NONE:
            raise ValueError("get_single_element: the dataset has more than one element; it "
                             "must have exactly one (use take(1) or batch it)")
    return first


_NONE = object()
