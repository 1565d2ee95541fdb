"""A torch DataLoader sharded per replica: each replica fetches only its share of every global batch.

``experimental_distribute_dataset(loader)`` (so ``fit``, ``evaluate`` and ``predict`` too) over a
map-style DataLoader with automatic batching (``batch_size=`` or ``batch_sampler=``) gives a
``ShardedLoader``. Each replica builds its own DataLoader over the same dataset (the loader's
``collate_fn``, workers, ``pin_memory``, ``worker_init_fn``, ``persistent_workers``, ...) whose
batch sampler walks the original batch sampler, the global batches, and yields only this replica's
index slice of each, cut as ``core.batches.split_sizes`` cuts a global batch: the replicas'
batches in rank order are the global batch, exactly the split ``DistributedIterator`` makes of the
whole batch, so the result is one process's on the same global batches while each replica's
``__getitem__`` runs on about 1/N of the examples. (A ``collate_fn`` that looks across a batch,
e.g. padding to its longest row, sees the replica's share instead of the global batch.)

Seeding: a sampler drawing from no generator of its own (``shuffle=True`` without ``generator=``,
``SubsetRandomSampler``, ``WeightedRandomSampler``) is given one seeded from the job seed (rank 0's
``torch.initial_seed()``, broadcast once: ``torch.manual_seed(s)`` before fit makes it ``s``) and
the pass, so every replica draws the same order and each epoch reshuffles. A user's generator is
kept: the replicas make the draws one process makes (they agree when it is seeded alike).

The position (pass, job seed, global batches consumed, and a user generator's state at the pass's
start) resumes exactly: the sampler skips the consumed global batches without fetching them. The
first global batch's sample indices join the first vote, so replicas that would read different
examples (an unseeded sampler of a custom ``batch_sampler``) stop with an error saying so.

Not sharded (each replica reads the whole global batches and keeps its slice, as for any
iterable): an IterableDataset's loader, a loader with ``batch_size=None`` (its dataset yields
batches) and DataLoader subclasses with their own ``__iter__``.
"""

from __future__ import annotations

import base64
import copy
import zlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from stratagem.comm import Communicator
from stratagem.core.batches import slice_batch, split_sizes, to_tensors
from stratagem.core.eager import eager_only
from stratagem.core.first_facts import FirstFacts
from stratagem.distribute.engines.input import PerReplicaIterator, _dataset_spec

_INDICES = "the first global batch's sample indices (crc32)"


def shards(dataset: Any) -> bool:
    """Whether ``dataset`` is a DataLoader each replica can read only its share of: map-style,
    automatic batching, DataLoader's own iteration."""
    return (
        isinstance(dataset, tud.DataLoader)
        and type(dataset).__iter__ is tud.DataLoader.__iter__
        and not isinstance(dataset.dataset, tud.IterableDataset)
        and dataset.batch_sampler is not None
    )


def _unseeded(sampler: Any) -> bool:
    """A torch sampler that would draw from torch's global RNG (different on every replica)."""
    return getattr(sampler, "generator", _ABSENT) is None


def pass_seed(seed: int, epoch: int) -> int:
    """The seed of pass ``epoch``'s sampler generator in a job of seed ``seed``."""
    words = np.random.SeedSequence([seed % 2**64, epoch]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


class _ShardBatches:
    """A batch sampler: this replica's slice of each global batch of ``source`` (a pass's batch
    sampler), after skipping ``skip`` global batches. A replica whose slice of a global batch is
    empty (fewer examples than replicas) fetches that batch's first example, and its batch is
    cut to zero rows (``empty``, in step with the batches out of the loader)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.source: Any = None
        self.skip = 0
        self.first: int | None = None  # crc32 of the pass's first global batch of indices
        self.empty: deque[bool] = deque()

    def begin(self, source: Any, skip: int) -> None:
        self.source, self.skip, self.first = source, skip, None
        self.empty.clear()

    def __iter__(self) -> Iterator[list[int]]:
        it = iter(self.source)
        for _ in range(self.skip):
            if next(it, _ABSENT) is _ABSENT:
                return
        for batch in it:
            indices = [int(i) for i in batch]
            if self.first is None:
                self.first = zlib.crc32(np.asarray(indices, dtype=np.int64).tobytes())
            sizes = split_sizes(len(indices), self.world)
            start = sum(sizes[: self.rank])
            mine = indices[start : start + sizes[self.rank]]
            self.empty.append(not mine)
            yield mine if mine else indices[:1]

    def __len__(self) -> int:
        return max(0, len(self.source) - self.skip)


@dataclass(frozen=True)
class _LoaderFacts(FirstFacts):
    """The first vote's facts: the optimizer's settings (``inner``) and the sample indices."""

    inner: FirstFacts | None = None

    def mismatch(self, everyone: Sequence[Mapping[str, str]]) -> str | None:
        if self.inner is not None:
            problem = self.inner.mismatch(
                [{k: v for k, v in e.items() if k != _INDICES} for e in everyone]
            )
            if problem is not None:
                return problem
        digests = [e.get(_INDICES, "no batch") for e in everyone]
        other = next((r for r, d in enumerate(digests) if d != digests[0]), None)
        if other is None:
            return None
        return (
            "the dataset yielded different first global batches on different replicas (the "
            f"DataLoader's sample indices: crc32 {digests[other]} on replica {other}, "
            f"{digests[0]} on replica 0); experimental_distribute_dataset expects every replica to "
            "see the same global batches: seed any shuffling alike on every replica (e.g. "
            "DataLoader(..., generator=torch.Generator().manual_seed(0)), or a batch_sampler "
            "drawing from a generator seeded so); a shuffle=True without a generator is seeded "
            "for the job already"
        )


class _Pass:
    """One pass over this replica's loader; counts the global batches it gave (its position)."""

    def __init__(self, owner: ShardedLoader, *position: Any) -> None:
        self.owner = owner
        self._begin(*position)

    def _begin(self, epoch: int, seed: int | None, skip: int, states: list[torch.Tensor]) -> None:
        """Pass ``epoch`` (job seed ``seed``) after its first ``skip`` global batches; ``states``:
        the user's generators' states at the pass's start (restored already)."""
        self.epoch, self.seed, self.consumed, self.states = epoch, seed, skip, states
        self.batches, self.it = self.owner._start(epoch, seed, skip)

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> Any:
        batch = next(self.it)
        self.consumed += 1
        if self.batches.empty.popleft():
            batch = slice_batch(to_tensors(batch), 0, 0)
        return batch

    @property
    def first(self) -> int | None:
        return self.batches.first

    def state_dict(self) -> dict[str, Any]:
        return {"loader": True, "epoch": self.epoch, "seed": self.seed, "consumed": self.consumed,
                "generators": [_encode(s) for s in self.states]}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._begin(*self.owner._restore(state))


class LoaderIterator(PerReplicaIterator):
    """This replica's batches of a ``ShardedLoader`` pass (its vote: ``PerReplicaIterator``'s),
    the first global batch's sample indices compared in the first vote."""

    source: _Pass

    def _first_facts(self) -> FirstFacts | None:
        inner = self.first_facts
        values = dict(inner.values) if inner is not None else {}
        if self.source.first is not None:
            values[_INDICES] = f"{self.source.first:08x}"
        return _LoaderFacts("the DataLoader's first global batches", values, "", inner)

    def state_dict(self) -> dict[str, Any]:
        return {"source": self.source.state_dict()}

    @staticmethod
    def reshard_state(states: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
        """Every replica's position is the same global one (pass, seed, global batches)."""
        return states[0]


class ShardedLoader:
    """A DataLoader as this replica's share of its global batches (see the module)."""

    resumable = True

    def __init__(
        self, loader: tud.DataLoader, comm: Communicator, device: torch.device | None
    ) -> None:
        self.loader = loader
        self.comm = comm
        self.device = device
        self.rank, self.world = comm.rank, comm.world_size
        sampler = getattr(loader.batch_sampler, "sampler", None)
        if isinstance(sampler, tud.DistributedSampler):
            raise TypeError(
                "this DataLoader's sampler is a DistributedSampler, which already gives each replica "
                "its own examples, while experimental_distribute_dataset (and fit) take global "
                "batches and shard a DataLoader themselves: pass DataLoader(dataset, "
                "batch_size=global_batch_size, shuffle=...) without the DistributedSampler, or keep "
                "one loader per replica with strategy.distribute_datasets_from_function(lambda ctx: "
                "loader) (its batch_size is then per replica)"
            )
        self.seed: int | None = None  # the job seed, for an unseeded sampler
        if _unseeded(sampler):
            self.seed = int(comm.broadcast_object(torch.initial_seed() if self.rank == 0 else None))
        self._generators: list[torch.Generator] = []  # a user's, whose state is the position
        for g in (loader.generator, getattr(sampler, "generator", None)):
            if isinstance(g, torch.Generator) and all(g is not h for h in self._generators):
                self._generators.append(g)
        self._passes = 0  # the next pass of a plain iter()
        self._persistent: tud.DataLoader | None = None
        self._persistent_batches: _ShardBatches | None = None

    @property
    def element_spec(self) -> Any:
        return _dataset_spec(self.loader)

    def cardinality(self) -> int:
        from stratagem.data.dataset import UNKNOWN_CARDINALITY

        return UNKNOWN_CARDINALITY

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> LoaderIterator:
        return self.iterator()

    def iterator(self, epoch: int | None = None, seed: int | None = None) -> LoaderIterator:
        """This replica's batches of pass ``epoch`` (the next pass when None); ``seed``: the job
        seed to draw with (a resumed job's), else this job's."""
        if epoch is None:
            epoch = self._passes
        if seed is not None and self.seed is not None:
            self.seed = int(seed)
        states = [g.get_state() for g in self._generators]
        return self._iterator(_Pass(self, epoch, self.seed, 0, states))

    def iterator_from_state(self, state: dict[str, Any]) -> LoaderIterator:
        """The pass saved by ``LoaderIterator.state_dict()``, resumed where it was."""
        return self._iterator(_Pass(self, *self._restore(state["source"])))

    def _iterator(self, source: _Pass) -> LoaderIterator:
        it = LoaderIterator(source, self.comm, self.device)  # type: ignore[arg-type]
        it._spec_owner = self
        return it

    def _restore(self, state: dict[str, Any]) -> tuple[int, int | None, int, list[torch.Tensor]]:
        saved = list(state.get("generators", []))
        if len(saved) != len(self._generators):
            raise ValueError(
                f"the saved DataLoader position has {len(saved)} generator states but this "
                f"DataLoader draws from {len(self._generators)} generators; resume with the same "
                "DataLoader (shuffle and generator as when it was saved)"
            )
        states = [_decode(s) for s in saved]
        for g, s in zip(self._generators, states):
            g.set_state(s)
        seed = state.get("seed")
        if seed is not None and self.seed is not None:
            self.seed = int(seed)
        return int(state["epoch"]), self.seed, int(state["consumed"]), states

    def _start(
        self, epoch: int, seed: int | None, skip: int
    ) -> tuple[_ShardBatches, Iterator[Any]]:
        """Begin pass ``epoch`` of this replica's loader: its batch sampler and iterator."""
        self._passes = epoch + 1
        source: Any = self.loader.batch_sampler
        sampler: Any = getattr(source, "sampler", None)
        if seed is not None and _unseeded(sampler):
            g = torch.Generator()
            g.manual_seed(pass_seed(seed, epoch))
            sampler = copy.copy(sampler)
            sampler.generator = g
            source = copy.copy(source)
            source.sampler = sampler
        if self.loader.persistent_workers and self.loader.num_workers > 0:
            # one loader, whose workers live across passes (so one pass at a time reads it, as
            # with the user's own persistent loader)
            if self._persistent is None:
                self._persistent_batches = _ShardBatches(self.rank, self.world)
                self._persistent = self._replica_loader(self._persistent_batches)
            batches, loader = self._persistent_batches, self._persistent
        else:
            batches = _ShardBatches(self.rank, self.world)
            loader = self._replica_loader(batches)
        assert batches is not None
        batches.begin(source, skip)
        return batches, iter(loader)

    def _replica_loader(self, batches: _ShardBatches) -> tud.DataLoader:
        """A DataLoader over the same dataset, as the user's is, that reads ``batches``."""
        lo = self.loader
        kw: dict[str, Any] = {
            "batch_sampler": batches, "num_workers": lo.num_workers, "collate_fn": lo.collate_fn,
            "pin_memory": lo.pin_memory, "timeout": lo.timeout, "worker_init_fn": lo.worker_init_fn,
            "multiprocessing_context": lo.multiprocessing_context, "generator": lo.generator,
            "prefetch_factor": lo.prefetch_factor, "persistent_workers": lo.persistent_workers,
            "pin_memory_device": lo.pin_memory_device,
        }  # fmt: skip
        if hasattr(lo, "in_order"):
            kw["in_order"] = True  # the replicas' slices must come out in the global batches' order
        return tud.DataLoader(lo.dataset, **kw)


def _encode(state: torch.Tensor) -> str:
    """A generator's state as text (a checkpoint's per-replica state is JSON)."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


_ABSENT: Any = object()

eager_only(ShardedLoader, ["__iter__"])
