"""Rebatch-shard: this worker's part of every global batch, cut before the per-element work.

tf.distribute's rebatching plan per global batch of ``s`` elements over ``n`` workers: worker
``i`` gets the ``i``-th contiguous run of ``split_sizes(s, n)`` (the first ``s mod n`` workers
one element more), so ``range(6).batch(4)`` on 2 workers gives [0,1]/[2,3], then [4]/[5]. This
node reads the upstream stream in groups of ``global_batch`` elements and yields only this
worker's run of each group; placed below the element-wise maps, each worker maps only its own
elements. Position state: the upstream state at the start of the current group and how many of
this worker's elements were taken from it (a restore re-reads the group).
"""

from __future__ import annotations

from typing import Any

from stratagem.core.batches import split_sizes
from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import UNKNOWN_CARDINALITY


class RebatchShardDataset(Dataset):
    """Worker ``index``'s run of each group of ``global_batch`` elements (see module doc)."""

    def __init__(self, input_ds: Dataset, global_batch: int, num_shards: int, index: int) -> None:
        if global_batch < 1 or num_shards < 1 or not 0 <= index < num_shards:
            raise ValueError(
                f"rebatch-shard: need global_batch >= 1 and 0 <= index < num_shards, got "
                f"global_batch={global_batch}, num_shards={num_shards}, index={index}"
            )
        self._inputs = (input_ds,)
        self._global_batch, self._num_shards, self._index = global_batch, num_shards, index

    def _cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if n < 0:
            return n
        full, rest = divmod(n, self._global_batch)
        mine = split_sizes(self._global_batch, self._num_shards)[self._index]
        return full * mine + split_sizes(rest, self._num_shards)[self._index]

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _RebatchShardIterator(self._inputs[0]._make_iterator(ctx.child(0)), self)

    def source_position(self, k: int) -> int | None:
        """The position in the input of this worker's ``k``-th element (0-based), when it is
        known exactly: in a full group, or in the last, partial one of an input of known length
        (None when the input's length is unknown and ``k`` may lie in a partial last group)."""
        sizes = split_sizes(self._global_batch, self._num_shards)
        mine, start = sizes[self._index], sum(sizes[: self._index])
        if mine == 0:
            return None
        n = self._inputs[0].cardinality()
        if n == UNKNOWN_CARDINALITY:
            return None
        if n >= 0:
            full = n // self._global_batch
            if k >= full * mine:  # in the last, partial group
                rest = split_sizes(n % self._global_batch, self._num_shards)
                offset = k - full * mine
                return full * self._global_batch + sum(rest[: self._index]) + offset if offset < rest[self._index] else None
        group, offset = divmod(k, mine)
        return group * self._global_batch + start + offset


class _RebatchShardIterator(StatefulIterator):
    def __init__(self, child: StatefulIterator, ds: RebatchShardDataset) -> None:
        self.children = [child]
        self.child = child
        self.b, self.n, self.i = ds._global_batch, ds._num_shards, ds._index
        self.group_state: dict[str, Any] | None = None  # upstream state at the group's start
        self.mine: list[Any] = []
        self.taken = 0

    def _read_group(self) -> None:
        self.group_state = self.child.state_dict()
        group = []
        for _ in range(self.b):
            try:
                group.append(next(self.child))
            except StopIteration:
                break
        if not group:
            self.group_state = None
            raise StopIteration
        sizes = split_sizes(len(group), self.n)
        start = sum(sizes[: self.i])
        self.mine = group[start : start + sizes[self.i]]
        self.taken = 0

    def __next__(self) -> Any:
        while self.taken >= len(self.mine):
            self._read_group()
        x = self.mine[self.taken]
        self.taken += 1
        return x

    def state_dict(self) -> dict[str, Any]:
        if self.taken < len(self.mine) and self.group_state is not None:
            return {"group": self.group_state, "taken": self.taken}
        return {"input": self.child.state_dict()}  # at a group boundary

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "group" in state:
            self.child.load_state_dict(state["group"])
            self._read_group()
            self.taken = int(state["taken"])
        else:
            self.child.load_state_dict(state["input"])
