"""Sequential element transformations: map, filter, repeat, take, skip, shard, enumerate, zip,
concatenate, with_options."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from stratagem.data.dataset import Dataset
from stratagem.data.functions import call_checked, element_rng
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Options
from stratagem.data.structure import flatten, normalize_output, pack_as


class _Unary(StatefulIterator):
    """An iterator over one input iterator, with a position counter in the current epoch."""

    def __init__(self, child: StatefulIterator) -> None:
        self.children = [child]
        self.child = child
        self.pos = 0

    def state_dict(self) -> dict[str, Any]:
        return {"input": self.child.state_dict(), "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])
        self.pos = int(state["pos"])


class MapDataset(Dataset):
    def __init__(
        self,
        input_ds: Dataset,
        fn: Callable[..., Any],
        with_rng: bool = False,
        seed: int | None = None,
        name: str | None = None,
    ) -> None:
        self._inputs = (input_ds,)
        self._fn, self._with_rng, self._seed, self._name = fn, with_rng, seed, name or "map"

    def _cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _MapIterator(self, ctx)


class _MapIterator(_Unary):
    def __init__(self, ds: MapDataset, ctx: Context) -> None:
        super().__init__(ds._inputs[0]._make_iterator(ctx.child(0)))
        self.ds, self.ctx = ds, ctx

    def __next__(self) -> Any:
        x = next(self.child)
        pos = self.pos
        self.pos += 1
        rng = element_rng(self.ctx.seed_sequence(self.ds._seed, pos)) if self.ds._with_rng else None
        return normalize_output(call_checked(self.ds._fn, x, pos, self.ds._name, rng))


class FilterDataset(Dataset):
    def __init__(self, input_ds: Dataset, predicate: Callable[..., Any]) -> None:
        self._inputs = (input_ds,)
        self._predicate = predicate

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _FilterIterator(self._inputs[0]._make_iterator(ctx.child(0)), self._predicate)


class _FilterIterator(_Unary):
    def __init__(self, child: StatefulIterator, predicate: Callable[..., Any]) -> None:
        super().__init__(child)
        self.predicate = predicate

    def __next__(self) -> Any:
        while True:
            x = next(self.child)
            self.pos += 1
            keep = call_checked(self.predicate, x, self.pos - 1, "filter")
            shape = tuple(getattr(keep, "shape", ()))
            if shape and math.prod(shape) != 1:
                raise ValueError(
                    f"filter: the predicate must return one bool per element; for element "
                    f"{self.pos - 1} it returned a tensor of shape {list(keep.shape)}"
                )
            if bool(keep):
                return x


class RepeatDataset(Dataset):
    def __init__(self, input_ds: Dataset, count: int | None) -> None:
        self._inputs = (input_ds,)
        self._count = -1 if count is None else int(count)

    def _cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if self._count == 0 or n == 0:
            return 0
        if self._count < 0:  # tf.data: repeating an unknown-length input forever is infinite
            return INFINITE_CARDINALITY
        return n * self._count if n >= 0 else n

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _RepeatIterator(self, ctx)


class _RepeatIterator(StatefulIterator):
    """Each repetition is a new epoch of the input (reshuffled where asked)."""

    def __init__(self, ds: RepeatDataset, ctx: Context) -> None:
        self.ds, self.ctx = ds, ctx
        self.epoch, self.got_any = 0, False
        self.children = [self._make(0)]

    def _make(self, epoch: int) -> StatefulIterator:
        return self.ds._inputs[0]._make_iterator(self.ctx.child(0).with_epoch(epoch))

    def __next__(self) -> Any:
        while self.ds._count < 0 or self.epoch < self.ds._count:
            try:
                x = next(self.children[0])
                self.got_any = True
                return x
            except StopIteration:
                if not self.got_any:  # an empty input repeats to nothing, like tf.data
                    self.epoch = max(self.ds._count, self.epoch + 1)
                    break
                self.children[0].close()
                self.epoch += 1
                self.got_any = False
                self.children = [self._make(self.epoch)]
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "got_any": self.got_any,
                "input": self.children[0].state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.got_any = int(state["epoch"]), bool(state["got_any"])
        self.children[0].close()
        self.children = [self._make(self.epoch)]
        self.children[0].load_state_dict(state["input"])


class TakeDataset(Dataset):
    def __init__(self, input_ds: Dataset, count: int) -> None:
        self._inputs = (input_ds,)
        self._count = int(count)

    def _cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if self._count < 0:
            return n
        if n == INFINITE_CARDINALITY:
            return self._count
        return min(n, self._count) if n >= 0 else UNKNOWN_CARDINALITY

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _TakeIterator(self._inputs[0]._make_iterator(ctx.child(0)), self._count)


class _TakeIterator(_Unary):
    def __init__(self, child: StatefulIterator, count: int) -> None:
        super().__init__(child)
        self.count = count

    def __next__(self) -> Any:
        if 0 <= self.count <= self.pos:
            raise StopIteration
        x = next(self.child)
        self.pos += 1
        return x


class SkipDataset(Dataset):
    def __init__(self, input_ds: Dataset, count: int) -> None:
        self._inputs = (input_ds,)
        self._count = int(count)

    def _cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if n < 0:
            return n
        return 0 if self._count < 0 else max(n - self._count, 0)

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _SkipIterator(self._inputs[0]._make_iterator(ctx.child(0)), self._count)


class _SkipIterator(_Unary):
    def __init__(self, child: StatefulIterator, count: int) -> None:
        super().__init__(child)
        self.count = count

    def __next__(self) -> Any:
        while self.count < 0 or self.pos < self.count:
            next(self.child)
            self.pos += 1
        return next(self.child)


class ShardDataset(Dataset):
    """Keeps elements whose position p satisfies ``p % num_shards == index``."""

    def __init__(self, input_ds: Dataset, num_shards: int, index: int) -> None:
        num_shards, index = int(num_shards), int(index)
        if num_shards < 1:
            raise ValueError(f"shard: num_shards must be >= 1, got {num_shards}")
        if not 0 <= index < num_shards:
            raise ValueError(
                f"shard: index must be in [0, {num_shards}) for {num_shards} shards, got {index}"
            )
        self._inputs = (input_ds,)
        self._num_shards, self._index = num_shards, index

    def _cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if n < 0:
            return n
        return max(0, (n - self._index + self._num_shards - 1) // self._num_shards)

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _ShardIterator(self._inputs[0]._make_iterator(ctx.child(0)), self)


class _ShardIterator(_Unary):
    def __init__(self, child: StatefulIterator, ds: ShardDataset) -> None:
        super().__init__(child)
        self.n, self.i = ds._num_shards, ds._index

    def __next__(self) -> Any:
        while True:
            x = next(self.child)
            self.pos += 1
            if (self.pos - 1) % self.n == self.i:
                return x


class EnumerateDataset(Dataset):
    def __init__(self, input_ds: Dataset, start: int) -> None:
        self._inputs = (input_ds,)
        self._start = int(start)

    def _cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _EnumerateIterator(self._inputs[0]._make_iterator(ctx.child(0)), self._start)


class _EnumerateIterator(_Unary):
    def __init__(self, child: StatefulIterator, start: int) -> None:
        super().__init__(child)
        self.start = start

    def __next__(self) -> Any:
        x = next(self.child)
        self.pos += 1
        return (torch.tensor(self.start + self.pos - 1, dtype=torch.int64), x)


class ZipDataset(Dataset):
    """Elements of several datasets side by side, as the same tuple/dict structure."""

    def __init__(self, datasets: tuple | dict) -> None:
        leaves = flatten(datasets)
        for d in leaves:
            if not isinstance(d, Dataset):
                raise TypeError(f"zip expects Datasets in a tuple or dict, got {type(d).__name__}")
        self._structure = datasets
        self._inputs = tuple(leaves)

    def _cardinality(self) -> int:
        ns = [d.cardinality() for d in self._inputs]
        finite = [n for n in ns if n >= 0]
        if finite:
            return min(finite)
        return UNKNOWN_CARDINALITY if UNKNOWN_CARDINALITY in ns else INFINITE_CARDINALITY

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        its = [d._make_iterator(ctx.child(i)) for i, d in enumerate(self._inputs)]
        return _ZipIterator(its, self._structure)


class _ZipIterator(StatefulIterator):
    def __init__(self, children: list[StatefulIterator], structure: Any) -> None:
        self.children, self.structure = children, structure

    def __next__(self) -> Any:
        return pack_as(self.structure, [next(c) for c in self.children])

    def state_dict(self) -> dict[str, Any]:
        return {"inputs": [c.state_dict() for c in self.children]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for c, s in zip(self.children, state["inputs"]):
            c.load_state_dict(s)


class ConcatenateDataset(Dataset):
    def __init__(self, first: Dataset, second: Dataset) -> None:
        if not isinstance(second, Dataset):
            raise TypeError(f"concatenate expects a Dataset, got {type(second).__name__}")
        self._inputs = (first, second)

    def _cardinality(self) -> int:
        a, b = (d.cardinality() for d in self._inputs)
        if INFINITE_CARDINALITY in (a, b):
            return INFINITE_CARDINALITY
        return a + b if a >= 0 and b >= 0 else UNKNOWN_CARDINALITY

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _ConcatIterator(self, ctx)


class _ConcatIterator(StatefulIterator):
    def __init__(self, ds: ConcatenateDataset, ctx: Context) -> None:
        self.ds, self.ctx, self.part = ds, ctx, 0
        self.children = [ds._inputs[0]._make_iterator(ctx.child(0))]

    def __next__(self) -> Any:
        while True:
            try:
                return next(self.children[0])
            except StopIteration:
                if self.part == 1:
                    raise
                self._switch()

    def _switch(self) -> None:
        self.children[0].close()
        self.part = 1
        self.children = [self.ds._inputs[1]._make_iterator(self.ctx.child(1))]

    def state_dict(self) -> dict[str, Any]:
        return {"part": self.part, "input": self.children[0].state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["part"]) == 1:
            self._switch()
        self.children[0].load_state_dict(state["input"])


class OptionsDataset(Dataset):
    def __init__(self, input_ds: Dataset, options: Options) -> None:
        self._inputs = (input_ds,)
        self._options = options

    def _own_options(self) -> Options:
        return self._options

    def _cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return self._inputs[0]._make_iterator(ctx.child(0))


class AssertCardinalityDataset(Dataset):
    """``assert_cardinality(n)``: declares the cardinality and checks it while iterating."""

    def __init__(self, input_ds: Dataset, expected: int) -> None:
        self._inputs = (input_ds,)
        self._expected = int(expected)

    def _cardinality(self) -> int:
        return self._expected

    def _spec(self) -> Any:
        from stratagem.data.spec import static_spec

        return static_spec(self._inputs[0])

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _AssertCardinalityIterator(self._inputs[0]._make_iterator(ctx.child(0)),
                                          self._expected)


class _AssertCardinalityIterator(_Unary):
    def __init__(self, child: StatefulIterator, expected: int) -> None:
        super().__init__(child)
        self.expected = expected

    def __next__(self) -> Any:
        try:
            x = next(self.child)
        except StopIteration:
            if self.expected >= 0 and self.pos < self.expected:
                raise ValueError(
                    f"assert_cardinality: the input dataset ended after {self.pos} elements but "
                    f"its cardinality was asserted to be {self.expected}"
                ) from None
            raise
        self.pos += 1
        if self.expected >= 0 and self.pos > self.expected:
            raise ValueError(
                f"assert_cardinality: the input dataset has more than {self.expected} elements "
                f"(its asserted cardinality)"
            )
        return x
