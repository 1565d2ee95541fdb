"""Distributed input: global batches split across replicas, per-replica pipelines, InputContext.

``core.batches.split_sizes`` is the plan (tf.distribute's rebatching: a batch of B over N replicas gives the
first B mod N replicas one element more than the others, so ``range(6).batch(4)`` on 2 replicas
gives [0,1]/[2,3] then [4]/[5], and a replica left without data gets a zero-size batch). The
iterators run it: every step the replicas agree (one tiny all-reduce) whether anyone still has
data, so an uneven end never hangs and the loop stops on every replica at once.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stratagem.comm import Communicator
from stratagem.comm.communicator import value_digest
from stratagem.comm.errors import ReplicaMismatchError
from stratagem.core import tree
from stratagem.core.batches import batch_size_of, place, slice_batch, split_sizes, to_tensors
from stratagem.core.eager import eager_only
from stratagem.core.first_facts import FirstFacts
from stratagem.data.functions import MapFunctionError
from stratagem.data.iterator import Optional, get_next, get_next_as_optional


@dataclass(frozen=True)
class InputContext:
    """What ``dataset_fn`` is told about the input pipeline it builds (tf.distribute.InputContext)."""

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by "
                f"{self.num_replicas_in_sync} replicas; use a multiple of "
                f"{self.num_replicas_in_sync} (e.g. "
                f"{(global_batch_size // self.num_replicas_in_sync + 1) * self.num_replicas_in_sync})"
            )
        return global_batch_size // self.num_replicas_in_sync


def _source(dataset: Iterable[Any], epoch: int | None, seed: int | None = None) -> Iterator[Any]:
    """A fresh iterator over ``dataset``: pass ``epoch`` of a stratagem Dataset (its shuffles
    are reseeded per epoch; ``seed`` for its unseeded randomness), else ``iter(dataset)``."""
    if epoch is not None and hasattr(dataset, "iterator_from_state"):
        return dataset.iterator(epoch=epoch, seed=seed)  # type: ignore[attr-defined, no-any-return]
    return iter(dataset)


def _restored(dataset: Iterable[Any], state: dict[str, Any]) -> Iterator[Any]:
    if not hasattr(dataset, "iterator_from_state"):
        raise TypeError(
            f"{type(dataset).__name__} cannot restore a position; use a stratagem.data Dataset "
            "to resume input exactly"
        )
    return dataset.iterator_from_state(state["source"])  # type: ignore[attr-defined, no-any-return]


class _Agreement:
    """The vote before batches are used: how many does each replica have (the most and the
    fewest), and (for global batches) did all get batches of the same structure, shapes and
    dtypes? One small all-reduce, for one batch or for a group of them."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def counts(self, count: int, signature: int = 0) -> tuple[int, int, bool]:
        if self.comm.world_size == 1:
            return count, count, True
        # max of (x, -x) gives max and -min at once: all equal iff max == min
        t = torch.tensor([count, -count, signature, -signature], dtype=torch.int64, device=self.comm.device)
        self.comm.all_reduce_(t, "max")
        most, least, sig_max, sig_min = t.tolist()
        return most, -least, sig_max == -sig_min


def _facts_error(comm: Communicator, facts: FirstFacts | None) -> None:
    """After a vote that disagreed: raise on every replica if ``facts`` differ (one gather, on the
    failure path only; every replica takes it, as every one saw the same vote)."""
    everyone = comm.all_gather_object(dict(facts.values) if facts is not None else None)
    if facts is None or any(e is None for e in everyone):
        return
    problem = facts.mismatch(everyone)
    if problem is not None:
        raise ReplicaMismatchError(problem)


def _floatx(x: Any) -> Any:
    """A numpy float array as float32 (fit casts Keras's array inputs so: floatx), else as is."""
    if isinstance(x, np.ndarray) and x.dtype.kind == "f" and x.dtype != np.float32:
        return x.astype(np.float32)
    return x


def _tensors(batch: Any) -> Any:
    """A batch's numpy arrays and lists of numbers as tensors, numpy floats as float32."""
    return to_tensors(tree.map_structure(_floatx, batch))


def _as_is(batch: Any, device: torch.device | None) -> Any:
    """``batch`` itself when it is a tuple or list of tensors with one batch size, already on
    ``device`` (nothing to convert, check or move); else None."""
    if type(batch) is not tuple and type(batch) is not list:
        return None
    size = -1
    for t in batch:
        if type(t) is not torch.Tensor or t.dim() == 0 or (device is not None and t.device != device):
            return None
        if size < 0:
            size = t.shape[0]
        elif t.shape[0] != size:
            return None
    return batch if size >= 0 else None


def _local(batch: Any, device: torch.device | None) -> Any:
    """A one-replica batch: as it is when possible, else converted, checked and placed."""
    same = _as_is(batch, device)
    if same is not None:
        return same
    batch = _tensors(batch)
    batch_size_of(batch)  # every leaf a tensor with one batch size, or a clear error
    return place(batch, device)


def _group_signature(batches: list[Any]) -> int:
    """A 31-bit digest of the structures, shapes and dtypes of ``batches``, in order."""
    return zlib.crc32("|".join(tree.signature(b) for b in batches).encode()) & 0x7FFFFFFF


def _read(source: Iterator[Any], n: int, convert: Callable[[Any], Any]) -> list[Any]:
    """Up to ``n`` elements of ``source``, each through ``convert`` (fewer at its end)."""
    out = []
    for _ in range(n):
        batch = next(source, _END)
        if batch is _END:
            break
        out.append(convert(batch))
    return out


def _cardinality(dataset: Any) -> int:
    """The number of batches ``dataset`` gives when it says (a stratagem Dataset's
    ``cardinality()``: ``INFINITE_CARDINALITY`` for ``repeat()``), else ``UNKNOWN_CARDINALITY``."""
    from stratagem.data.dataset import UNKNOWN_CARDINALITY, Dataset

    return dataset.cardinality() if isinstance(dataset, Dataset) else UNKNOWN_CARDINALITY


def _dataset_spec(dataset: Any) -> Any:
    """The ``element_spec`` of the dataset a distributed dataset reads, or a clear error."""
    from stratagem.data.dataset import Dataset

    if not isinstance(dataset, Dataset):
        raise TypeError(
            f"element_spec needs a stratagem.data Dataset, but this distributed dataset reads a "
            f"{type(dataset).__name__}, which has no static element structure; build the input "
            "with stratagem.data.Dataset (e.g. Dataset.from_tensor_slices((x, y)).batch(b))"
        )
    return dataset.element_spec


def _per_replica_spec(spec: Any, replicas: int) -> Any:
    """A global batch's spec as one replica's share of it (tf's per-replica element_spec): a
    known batch dimension divided by the replicas when it divides evenly, else unknown."""
    from stratagem.data.spec import TensorSpec
    from stratagem.data.structure import flatten, pack_as

    if replicas == 1:
        return spec
    out = []
    for s in flatten(spec):
        if isinstance(s, TensorSpec) and s.shape:
            first = s.shape[0]
            size = first // replicas if first is not None and first % replicas == 0 else None
            s = TensorSpec((size, *s.shape[1:]), s.dtype)
        out.append(s)
    return pack_as(spec, out)


class _IteratorApi:
    """tf's iterator methods on the distributed iterators: ``get_next()`` (OutOfRangeError at
    the end), ``get_next_as_optional()`` and ``element_spec`` (asked of the distributed
    dataset only when read: a dataset without a static spec runs to its first element)."""

    _spec_owner: Any = None

    def get_next(self) -> Any:
        return get_next(self)

    def get_next_as_optional(self) -> Optional:
        return get_next_as_optional(self)

    @property
    def element_spec(self) -> Any:
        if self._spec_owner is None:
            raise TypeError(
                "this iterator was not made by a distributed dataset, so it has no "
                "element_spec; use strategy.experimental_distribute_dataset(dataset)"
            )
        return self._spec_owner.element_spec


def _with_spec(it: Any, owner: Any) -> Any:
    it._spec_owner = owner
    return it


def check_batches(dataset: Any, what: str = "experimental_distribute_dataset") -> None:
    """A clear error for whole arrays given where an iterable of global batches is expected:
    ``(x, y)`` of tensors would be read as two batches, ``x`` then ``y``."""
    if isinstance(dataset, (torch.Tensor, np.ndarray)):
        raise TypeError(
            f"{what} got one whole {type(dataset).__name__} of shape {tuple(dataset.shape)}; it takes "
            "an iterable of global batches (each row would be read as a batch). Batch it first: "
            "Dataset.from_tensor_slices(x).batch(global_batch_size)"
        )
    if not isinstance(dataset, (tuple, list)) or not dataset or hasattr(dataset, "_fields"):
        return
    arrays = [d for d in dataset if isinstance(d, (torch.Tensor, np.ndarray)) and d.ndim > 0]
    if len(arrays) != len(dataset):
        return
    shapes = [tuple(a.shape) for a in arrays]
    # a tuple of arrays is (x, y[, w]); a list of arrays is a list of batches of x, unless they
    # are arrays of different kinds over the same rows (one leading size, other ranks): [x, y]
    if isinstance(dataset, list) and (len({s[0] for s in shapes}) != 1 or len({len(s) for s in shapes}) == 1):
        return
    names = "(x, y)" if len(arrays) == 2 else "(x, y, sample_weight)" if len(arrays) == 3 else "(x, ...)"
    raise TypeError(
        f"{what} got a {type(dataset).__name__} of {len(arrays)} whole arrays (shapes "
        f"{', '.join(str(list(s)) for s in shapes)}); it takes an iterable of global batches, so "
        f"each array would be read as one batch. Make a dataset of their rows and batch it: "
        f"Dataset.from_tensor_slices({names}).batch(global_batch_size)"
    )


class DistributedDataset:
    """Global batches from ``dataset``; each replica iterates over its slices of them."""

    def __init__(self, dataset: Iterable[Any], comm: Communicator, device: torch.device | None) -> None:
        check_batches(dataset)
        self.dataset = dataset
        self.comm = comm
        self.device = device

    @property
    def element_spec(self) -> Any:
        """One replica's share of the dataset's spec (tf's per-replica element_spec)."""
        return _per_replica_spec(_dataset_spec(self.dataset), self.comm.world_size)

    def cardinality(self) -> int:
        """The global batches of one pass (``INFINITE_CARDINALITY`` for a ``repeat()``ed
        dataset, ``UNKNOWN_CARDINALITY`` when the dataset does not say)."""
        return _cardinality(self.dataset)

    @property
    def resumable(self) -> bool:
        """Whether iterators over this dataset can save and restore their position."""
        return hasattr(self.dataset, "iterator_from_state")

    def __iter__(self) -> Iterator[Any]:
        return _with_spec(DistributedIterator(iter(self.dataset), self.comm, self.device), self)

    def iterator(self, epoch: int | None = None, seed: int | None = None) -> DistributedIterator:
        """An iterator over pass ``epoch`` of the dataset."""
        return _with_spec(
            DistributedIterator(_source(self.dataset, epoch, seed), self.comm, self.device), self
        )

    def iterator_from_state(self, state: dict[str, Any]) -> DistributedIterator:
        """An iterator resumed from ``DistributedIterator.state_dict()``."""
        it = DistributedIterator(_restored(self.dataset, state), self.comm, self.device)
        it._checked = bool(state.get("checked", False))
        return _with_spec(it, self)


class DistributedIterator(_IteratorApi):
    """Splits each global batch. Every step's vote also compares the global batch's structure,
    shapes and dtypes across replicas (no extra collective); the first batch's values are
    compared once."""

    def __init__(self, source: Iterator[Any], comm: Communicator, device: torch.device | None) -> None:
        self.source = source
        self.comm = comm
        self.device = device
        self.vote = _Agreement(comm)
        self._checked = False
        self._step = 0  # global batches taken (named in errors)
        self.first_facts: FirstFacts | None = None  # compared in the first vote too (agree_first)

    def __iter__(self) -> DistributedIterator:
        return self

    def agree_first(self, facts: FirstFacts | None) -> None:
        """Compare ``facts`` across replicas in the first batch's vote too (fit: the
        optimizer's settings); a difference is a ReplicaMismatchError naming it."""
        self.first_facts = facts

    def state_dict(self) -> dict[str, Any]:
        """The position of the underlying iterator (a stratagem.data iterator can resume)."""
        if not hasattr(self.source, "state_dict"):
            raise TypeError(
                f"{type(self.source).__name__} cannot save its position; use a stratagem.data "
                "Dataset to resume input exactly"
            )
        return {"source": self.source.state_dict(), "checked": self._checked}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not hasattr(self.source, "load_state_dict"):
            raise TypeError(f"{type(self.source).__name__} cannot restore a position")
        self.source.load_state_dict(state["source"])
        self._checked = bool(state.get("checked", False))

    @staticmethod
    def reshard_state(states: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
        """This replica's state from the states saved by another number of replicas: every
        replica reads the same global batches, so any saved one is the position (exact)."""
        return states[0]

    def __next__(self) -> Any:
        batches = self.next_batches(1)
        if not batches:
            raise StopIteration
        return batches[0]

    def next_batches(self, n: int) -> list[Any]:
        """This replica's slices of up to ``n`` next global batches (fewer at the end, none
        after it), agreed on in one vote for all of them: fit takes an execution's batches so,
        one collective per execution instead of one per batch (``next()`` is ``next_batches(1)``)."""
        start = self._step
        if self.comm.world_size == 1:  # nothing to split or agree on
            batches = _read(self.source, n, lambda b: _local(b, self.device))
            self._step += len(batches)
            return batches
        batches = _read(self.source, n, _tensors)
        self._step += len(batches)
        signature = _group_signature(batches)
        first = not self._checked
        if first and batches:  # the first global batch's bytes too, in the same vote
            signature = zlib.crc32(f"{signature}:{value_digest(batches[0])}".encode()) & 0x7FFFFFFF
        if first and self.first_facts is not None:  # and the settings every replica must share
            signature = zlib.crc32(f"{signature}:{self.first_facts.digest()}".encode()) & 0x7FFFFFFF
        most, least, same = self.vote.counts(len(batches), signature)
        if not same and first:
            _facts_error(self.comm, self.first_facts)
        if most == 0:
            return []
        if least < most:
            raise RuntimeError(
                "the dataset ended on some replicas but not on others; experimental_distribute_dataset "
                "expects every replica to see the same global batches (use "
                "distribute_datasets_from_function for per-replica pipelines)"
            )
        if not same:
            sigs = self.comm.all_gather_object([tree.signature(b) for b in batches])
            i = next((i for i in range(len(batches)) if len({s[i] for s in sigs}) > 1), None)
            if i is None:  # alike in structure: the first batch's values differ
                raise ReplicaMismatchError(
                    "the dataset yielded different first global batches on different replicas; "
                    "experimental_distribute_dataset expects every replica to see the same global "
                    "batches: seed any shuffling (e.g. DataLoader(..., generator=torch.Generator()"
                    ".manual_seed(0))) or use distribute_datasets_from_function"
                )
            listing = "; ".join(f"replica {r}: {s[i]}" for r, s in enumerate(sigs))
            raise RuntimeError(
                f"global batch {start + i} has different structures, shapes or dtypes on "
                f"different replicas ({listing}); experimental_distribute_dataset expects every "
                "replica to see the same global batches: build the dataset alike on every worker "
                "(same files, same seed)"
            )
        self._checked = True
        return [self._mine(b) for b in batches]

    def _mine(self, batch: Any) -> Any:
        """This replica's slice of a global batch, on its device."""
        size = batch_size_of(batch)
        n, r = self.comm.world_size, self.comm.rank
        sizes = split_sizes(size, n)
        start = sum(sizes[:r])
        return place(slice_batch(batch, start, start + sizes[r]), self.device)


class PerReplicaDatasets:
    """Per-replica batches from ``dataset_fn(InputContext)``, one input pipeline per process."""

    def __init__(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        comm: Communicator,
        device: torch.device | None,
        num_replicas_in_sync: int,
    ) -> None:
        self.comm = comm
        self.device = device
        ctx = InputContext(comm.world_size, comm.rank, num_replicas_in_sync)
        self.dataset = dataset_fn(ctx)

    @property
    def element_spec(self) -> Any:
        """The spec of this replica's dataset (what ``dataset_fn`` built)."""
        return _dataset_spec(self.dataset)

    def cardinality(self) -> int:
        """The batches of one pass of this replica's dataset (``INFINITE_CARDINALITY``,
        ``UNKNOWN_CARDINALITY`` as a stratagem Dataset says)."""
        return _cardinality(self.dataset)

    @property
    def resumable(self) -> bool:
        return hasattr(self.dataset, "iterator_from_state")

    def __iter__(self) -> Iterator[Any]:
        return _with_spec(PerReplicaIterator(iter(self.dataset), self.comm, self.device), self)

    def iterator(self, epoch: int | None = None, seed: int | None = None) -> PerReplicaIterator:
        return _with_spec(
            PerReplicaIterator(_source(self.dataset, epoch, seed), self.comm, self.device), self
        )

    def iterator_from_state(self, state: dict[str, Any]) -> PerReplicaIterator:
        return _with_spec(
            PerReplicaIterator(_restored(self.dataset, state), self.comm, self.device), self
        )


class ShardedDataset:
    """This replica's share of a rebatched, auto-sharded stratagem Dataset.

    With ``drop_remainder`` the loop ends as soon as one replica's share ends (the global batch
    it belongs to would be partial, and the global pipeline drops it); otherwise replicas that
    run out take zero-size batches until every share has ended.
    """

    def __init__(self, dataset: Iterable[Any], comm: Communicator, device: torch.device | None, *, drop_remainder: bool) -> None:
        self.dataset = dataset
        self.comm = comm
        self.device = device
        self.drop_remainder = drop_remainder

    @property
    def element_spec(self) -> Any:
        """The spec of this replica's share (its rebatched, auto-sharded dataset)."""
        return _dataset_spec(self.dataset)

    def cardinality(self) -> int:
        """The batches of one pass of this replica's share (``INFINITE_CARDINALITY`` for a
        ``repeat()``ed dataset)."""
        return _cardinality(self.dataset)

    @property
    def resumable(self) -> bool:
        return hasattr(self.dataset, "iterator_from_state")

    def __iter__(self) -> Iterator[Any]:
        return self.iterator()

    def iterator(self, epoch: int | None = None, seed: int | None = None) -> PerReplicaIterator:
        return _with_spec(PerReplicaIterator(
            _source(self.dataset, epoch, seed), self.comm, self.device, stop_when_uneven=self.drop_remainder,
            renumber=self._renumber,
        ), self)

    def iterator_from_state(self, state: dict[str, Any]) -> PerReplicaIterator:
        return _with_spec(PerReplicaIterator(
            _restored(self.dataset, state), self.comm, self.device, stop_when_uneven=self.drop_remainder,
            renumber=self._renumber,
        ), self)

    def _renumber(self, error: MapFunctionError) -> MapFunctionError | None:
        """A map error in this replica's share, numbering the element within the whole dataset."""
        from stratagem.data.dataset import Dataset
        from stratagem.data.sharding import renumbered

        return renumbered(self.dataset, error) if isinstance(self.dataset, Dataset) else None


class PerReplicaIterator(_IteratorApi):
    """Yields this replica's batches; once its pipeline ends while others go on, zero-size ones."""

    def __init__(
        self, source: Iterator[Any], comm: Communicator, device: torch.device | None, *, stop_when_uneven: bool = False,
        renumber: Callable[[MapFunctionError], MapFunctionError | None] | None = None,
    ) -> None:  # fmt: skip
        self.source = source
        self.renumber = renumber  # a map error numbered within the dataset, not this share
        self.comm = comm
        self.device = device
        self.vote = _Agreement(comm)
        self.stop_when_uneven = stop_when_uneven
        self._empty: Any = None
        self._stopped = False  # stop_when_uneven: a replica's pipeline ended, so all did
        self._voted = False  # the first vote also compares first_facts
        self.first_facts: FirstFacts | None = None

    def __iter__(self) -> PerReplicaIterator:
        return self

    def agree_first(self, facts: FirstFacts | None) -> None:
        """Compare ``facts`` across replicas in the first vote (see ``DistributedIterator``)."""
        self.first_facts = facts

    def state_dict(self) -> dict[str, Any]:
        """The position of this replica's pipeline (a stratagem.data iterator can resume)."""
        if not hasattr(self.source, "state_dict"):
            raise TypeError(f"{type(self.source).__name__} cannot save its position")
        return {"source": self.source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not hasattr(self.source, "load_state_dict"):
            raise TypeError(f"{type(self.source).__name__} cannot restore a position")
        self.source.load_state_dict(state["source"])

    def __next__(self) -> Any:
        batches = self.next_batches(1)
        if not batches:
            raise StopIteration
        return batches[0]

    def next_batches(self, n: int) -> list[Any]:
        """Up to ``n`` of this replica's next batches, agreed on in one vote: while any replica
        has batches the others take zero-size ones (or, ``stop_when_uneven``, all stop where the
        first ran out); none once every replica's pipeline has ended."""
        if self.comm.world_size == 1:  # nothing to agree on
            return _read(self.source, n, lambda b: _local(b, self.device))
        if self._stopped:
            return []
        try:
            batches = _read(self.source, n, self._convert)
        except MapFunctionError as e:
            better = self.renumber(e) if self.renumber is not None else None
            if better is None:
                raise
            raise better from e.__cause__
        facts = self._first_facts() if not self._voted else None
        most, least, same = self.vote.counts(len(batches), facts.digest() if facts is not None else 0)
        if not self._voted and not same:
            _facts_error(self.comm, facts)
        self._voted = True
        if self.stop_when_uneven and least < most:
            self._stopped = True
            most = least
        if most == 0:
            return []
        if least < most:
            empty = self._empty_from_peers()
            batches += [empty] * (most - len(batches))
        return [place(b, self.device) for b in batches[:most]]

    def _first_facts(self) -> FirstFacts | None:
        """What the first vote compares, asked once the first batches are read (a sharded
        DataLoader adds the first global batch's sample indices then)."""
        return self.first_facts

    def _convert(self, batch: Any) -> Any:
        batch = _tensors(batch)
        batch_size_of(batch)
        if self._empty is None:
            self._empty = slice_batch(batch, 0, 0)
        return batch

    def _empty_from_peers(self) -> Any:
        """A zero-size batch shaped like the replicas' batches (this one's, else a peer's); a
        collective: every replica asks when any lacks a batch."""
        # zero-size batches are tiny: the peers' own empty batches carry structure, shapes, dtypes
        empties = self.comm.all_gather_object(self._empty)
        empty = self._empty if self._empty is not None else next((e for e in empties if e is not None), None)
        if empty is None:
            raise RuntimeError("no replica has seen a batch to shape an empty batch after")
        return empty


_END: Any = object()


# a step compiled with stratagem.function that iterates a distributed dataset (tf's
# "iterating inside a tf.function") takes each batch eagerly: the vote is a collective, and the
# iterators' Python state would otherwise be specialised into the graph (a recompilation a step)
eager_only(DistributedIterator, ["__next__", "next_batches"])
eager_only(PerReplicaIterator, ["__next__", "next_batches"])
for _dataset in (DistributedDataset, ShardedDataset, PerReplicaDatasets):
    eager_only(_dataset, ["__iter__"])
