"""shuffle(buffer_size): tf.data's buffer shuffle, reseeded per epoch, with a compact resumable state."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator


class ShuffleDataset(Dataset):
    """Fill a buffer of ``buffer_size`` elements, return one picked uniformly at random and
    replace it by the next input element; once the input ends, drain the buffer randomly.

    The random stream is seeded from (seed, epoch); with ``reshuffle_each_iteration=False``
    from the seed alone, so every epoch has the same order.
    """

    def __init__(
        self, input_ds: Dataset, buffer_size: int, seed: int | None, reshuffle: bool
    ) -> None:
        if int(buffer_size) < 1:
            raise ValueError(f"shuffle: buffer_size must be >= 1, got {buffer_size}")
        self._inputs = (input_ds,)
        self._buffer_size, self._seed, self._reshuffle = int(buffer_size), seed, reshuffle

    def _cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        seed_ctx = ctx if self._reshuffle else dataclasses.replace(ctx, epoch=())
        rng = np.random.Generator(np.random.PCG64(seed_ctx.seed_sequence(self._seed)))
        return _ShuffleIterator(self._inputs[0]._make_iterator(ctx.child(0)), self._buffer_size, rng)


def _rng_state(rng: np.random.Generator) -> dict[str, Any]:
    st = rng.bit_generator.state
    return {
        "state": str(st["state"]["state"]),
        "inc": str(st["state"]["inc"]),
        "has_uint32": int(st["has_uint32"]),
        "uinteger": int(st["uinteger"]),
    }


def _set_rng_state(rng: np.random.Generator, s: dict[str, Any]) -> None:
    rng.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": int(s["state"]), "inc": int(s["inc"])},
        "has_uint32": int(s["has_uint32"]),
        "uinteger": int(s["uinteger"]),
    }


class _ShuffleIterator(StatefulIterator):
    """State: the input state before the oldest buffered element, which buffer slots hold
    which later positions, and the RNG. Restoring re-reads that window of the input."""

    def __init__(self, child: StatefulIterator, size: int, rng: np.random.Generator) -> None:
        self.child, self.children = child, [child]
        self.size, self.rng = size, rng
        self.buf: list[tuple[Any, int]] = []
        self.snaps: dict[int, Any] = {}
        self.pos = 0
        self.hole: int | None = None
        self.input_done = False

    def _pull(self) -> tuple[Any, int] | None:
        if self.input_done:
            return None
        snap = self.child.state_dict()
        try:
            x = next(self.child)
        except StopIteration:
            self.input_done = True
            return None
        self.snaps[self.pos] = snap
        self.pos += 1
        return x, self.pos - 1

    def __next__(self) -> Any:
        if self.hole is not None:
            item = self._pull()
            if item is not None:
                self.buf[self.hole] = item
            else:
                self.buf[self.hole] = self.buf[-1]
                self.buf.pop()
            self.hole = None
        while len(self.buf) < self.size:
            item = self._pull()
            if item is None:
                break
            self.buf.append(item)
        if not self.buf:
            raise StopIteration
        i = int(self.rng.integers(len(self.buf)))
        x, p = self.buf[i]
        del self.snaps[p]
        self.hole = i
        return x

    def state_dict(self) -> dict[str, Any]:
        live = [p for i, (_, p) in enumerate(self.buf) if i != self.hole]
        if live:
            base = min(live)
            input_state = self.snaps[base]
        else:
            base, input_state = self.pos, self.child.state_dict()
        return {
            "input": input_state,
            "base": base,
            "replay": self.pos - base,
            "window": [-1 if i == self.hole else p - base for i, (_, p) in enumerate(self.buf)],
            "input_done": self.input_done,
            "rng": _rng_state(self.rng),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])
        base = int(state["base"])
        self.pos = base
        got: dict[int, Any] = {}
        for _ in range(int(state["replay"])):
            snap = self.child.state_dict()
            x = next(self.child)
            got[self.pos] = (x, snap)
            self.pos += 1
        self.buf, self.snaps, self.hole = [], {}, None
        for i, rel in enumerate(state["window"]):
            if rel < 0:
                self.hole = i
                self.buf.append((None, -1))
                continue
            x, snap = got[base + rel]
            self.buf.append((x, base + rel))
            self.snaps[base + rel] = snap
        self.input_done = bool(state["input_done"])
        _set_rng_state(self.rng, state["rng"])
