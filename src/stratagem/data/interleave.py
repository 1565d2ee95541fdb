"""interleave / flat_map: tf.data's cycle and block order, with optional per-slot threads."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import Any

from stratagem.data.dataset import Dataset
from stratagem.data.functions import call_checked
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import AUTOTUNE
from stratagem.data.prefetch import BackgroundIterator


class InterleaveDataset(Dataset):
    """Up to ``cycle_length`` datasets from ``map_func`` read round-robin, ``block_length``
    elements at a time; an exhausted slot is refilled from the next input element when the
    cycle comes back to it (exactly tf.data's order). ``num_parallel_calls`` (an int or
    AUTOTUNE) reads every open slot ahead on its own thread and opens the next
    ``cycle_length`` inputs in advance; the order stays the same unless
    ``deterministic=False``, which lets a ready slot overtake a slow one.
    """

    def __init__(
        self,
        input_ds: Dataset,
        map_func: Callable[..., Dataset],
        cycle_length: int | None,
        block_length: int | None,
        num_parallel_calls: int | None,
        deterministic: bool | None,
    ) -> None:
        if cycle_length is None or cycle_length == AUTOTUNE:
            cycle_length = os.cpu_count() or 1
        if block_length is None:
            block_length = 1
        if int(cycle_length) < 1 or int(block_length) < 1:
            raise ValueError(
                f"interleave: cycle_length and block_length must be >= 1, got "
                f"{cycle_length} and {block_length}"
            )
        self._inputs = (input_ds,)
        self._fn = map_func
        self._cycle, self._block = int(cycle_length), int(block_length)
        self._parallel = num_parallel_calls is not None
        self._deterministic = deterministic
        self._name = "flat_map" if (self._cycle, self._block) == (1, 1) else "interleave"

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _InterleaveIterator(self, ctx)


class _Slot:
    __slots__ = ("snap", "it", "pos")

    def __init__(self, snap: Any, it: StatefulIterator, pos: int) -> None:
        self.snap, self.it, self.pos = snap, it, pos


class _InterleaveIterator(StatefulIterator):
    def __init__(self, ds: InterleaveDataset, ctx: Context) -> None:
        self.ds, self.ctx = ds, ctx
        self.input = ds._inputs[0]._make_iterator(ctx.child(0))
        self.input_pos = 0
        self.input_done = False
        self.slots: list[_Slot | None] = [None] * ds._cycle
        self.futures: collections.deque[tuple[int, _Slot]] = collections.deque()
        self.ci = self.bi = 0
        self.deterministic = (
            ctx.options.resolved_deterministic if ds._deterministic is None else ds._deterministic
        )

    @property
    def children(self) -> list[StatefulIterator]:  # type: ignore[override]
        its = [s.it for s in self.slots if s is not None]
        return [self.input, *its, *(s.it for _, s in self.futures)]

    def _open(self, x: Any, pos: int, snap: Any) -> _Slot:
        sub = call_checked(self.ds._fn, x, pos, self.ds._name)
        if not isinstance(sub, Dataset):
            raise TypeError(
                f"{self.ds._name}: map_func must return a stratagem Dataset, got "
                f"{type(sub).__name__} for element {pos}"
            )
        it = sub._make_iterator(self.ctx.child(1).child(pos))
        if self.ds._parallel:
            it = BackgroundIterator(it, max(8, self.ds._block), self.ctx.options, "interleave")
        return _Slot(snap, it, pos)

    def _pull(self) -> tuple[int, _Slot] | None:
        snap = self.input.state_dict()
        try:
            x = next(self.input)
        except StopIteration:
            return None
        pos = self.input_pos
        self.input_pos += 1
        return pos, self._open(x, pos, snap)

    def _next_slot(self) -> _Slot | None:
        slot: _Slot | None
        if self.futures:
            slot = self.futures.popleft()[1]
        elif self.input_done:
            return None
        else:
            pulled = self._pull()
            slot = pulled[1] if pulled else None
        if self.ds._parallel:  # open the next inputs ahead of time
            while len(self.futures) < self.ds._cycle and not self.input_done:
                pulled = self._pull()
                if pulled is None:
                    self.input_done = True
                    break
                assert isinstance(pulled[1].it, BackgroundIterator)
                pulled[1].it.start()
                self.futures.append(pulled)
        if slot is None:
            self.input_done = True
        return slot

    def _advance(self) -> None:
        self.ci = (self.ci + 1) % self.ds._cycle
        self.bi = 0

    def _pick_ready(self) -> None:
        """deterministic=False: move to a slot that has an element ready, if the current
        one has none."""
        slot = self.slots[self.ci]
        if slot is None or not isinstance(slot.it, BackgroundIterator) or slot.it.ready():
            return
        n = self.ds._cycle
        for k in range(1, n):
            other = self.slots[(self.ci + k) % n]
            if other is not None and isinstance(other.it, BackgroundIterator) and other.it.ready():
                self.ci, self.bi = (self.ci + k) % n, 0
                return

    def __next__(self) -> Any:
        while True:
            if not self.deterministic:
                self._pick_ready()
            slot = self.slots[self.ci]
            if slot is None:
                if self.input_done and not self.futures:
                    if all(s is None for s in self.slots):
                        raise StopIteration
                    self._advance()
                    continue
                self.slots[self.ci] = self._next_slot()
                if self.slots[self.ci] is None:
                    self._advance()
                continue
            try:
                x = next(slot.it)
            except StopIteration:
                slot.it.close()
                self.slots[self.ci] = None
                self._advance()
                continue
            self.bi += 1
            if self.bi >= self.ds._block:
                self._advance()
            return x

    def state_dict(self) -> dict[str, Any]:
        if self.futures:
            input_state, input_pos = self.futures[0][1].snap, self.futures[0][0]
        else:
            input_state, input_pos = self.input.state_dict(), self.input_pos
        slots = [
            None if s is None else {"input": s.snap, "slot": s.it.state_dict()} for s in self.slots
        ]
        return {
            "input": input_state,
            "input_pos": input_pos,
            "input_done": self.input_done and not self.futures,
            "slots": slots,
            "slot_pos": [None if s is None else s.pos for s in self.slots],
            "cycle_index": self.ci,
            "block_index": self.bi,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.input.load_state_dict(state["input"])
        self.input_pos = int(state["input_pos"])
        self.input_done = bool(state["input_done"])
        self.ci, self.bi = int(state["cycle_index"]), int(state["block_index"])
        for i, (s, pos) in enumerate(zip(state["slots"], state["slot_pos"])):
            if s is None:
                continue
            replay = self.ds._inputs[0]._make_iterator(self.ctx.child(0))
            try:
                replay.load_state_dict(s["input"])
                x = next(replay)
            finally:
                replay.close()
            slot = self._open(x, int(pos), s["input"])
            slot.it.load_state_dict(s["slot"])
            self.slots[i] = slot

    def close(self) -> None:
        for child in self.children:
            child.close()
