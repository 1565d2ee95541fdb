"""GlobalBatches: the batches fit reads epoch by epoch, and a position it can save/restore.

``data`` is a stratagem Dataset, a torch DataLoader or any re-iterable of global batches; fit
reads it through the strategy's ``experimental_distribute_dataset`` (so a stratagem Dataset
ending in ``batch(B)`` is rebatched and auto-sharded: each replica's pipeline reads only its own
share), and the position is kept on the distributed iterator. With
``steps_per_epoch=None`` every epoch is one fresh pass over ``data``. With ``steps_per_epoch=k``
an epoch is the next ``k`` batches of the current pass (so an infinite ``Dataset.repeat()`` works);
a pass that ends starts the next one, and an epoch that reaches the end of a pass ends early.

The position (pass, batches consumed in the pass and in the epoch) can be saved after any step.
For a stratagem Dataset it includes this replica's pipeline state, so a restore resumes the
pipeline exactly (shuffles included; pass ``p`` is ``data.iterator(epoch=p)``). For other
iterables a restore replays pass ``p`` from its start and skips the consumed batches: exact only
when iterating ``data`` again gives the same batches (no unseeded shuffling). A map-style torch
DataLoader on several replicas is sharded and seeded per job (``distribute.engines.loader``): its
position (pass, job seed, global batches, a user generator's state) resumes exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from stratagem.comm.errors import ReplicaMismatchError
from stratagem.core.batches import place, to_tensors
from stratagem.core.first_facts import FirstFacts
from stratagem.data import INFINITE_CARDINALITY, Dataset, shards_by_files
from stratagem.distribute.strategy import Strategy


def is_distributed(data: Any) -> bool:
    """Whether ``data`` already yields per-replica batches (a strategy's distributed dataset)."""
    return hasattr(data, "iterator") and hasattr(data, "resumable") and not isinstance(data, Dataset)


def known_length(data: Any) -> int | None:
    """The number of batches in one pass over ``data`` when it is known without iterating."""
    if isinstance(data, Dataset):
        n = data.cardinality()
        return n if n >= 0 else None
    try:
        return len(data)
    except TypeError:
        return None


def check_iterable(data: Any, what: str) -> None:
    if isinstance(data, Iterator) and not isinstance(data, Dataset):
        raise TypeError(
            f"{what} is an iterator ({type(data).__name__}), which can be read only once; pass "
            "something fit can iterate again each epoch: a stratagem Dataset, a DataLoader, a list"
        )
    if not isinstance(data, Iterable):
        raise TypeError(
            f"{what} must yield batches: a stratagem Dataset, a torch DataLoader or an iterable "
            f"of (x, y) global batches; got {type(data).__name__}"
        )


def distributed(strategy: Strategy, data: Any) -> Any:
    """``data`` as this replica's batches: through ``experimental_distribute_dataset`` unless it
    already is a distributed dataset."""
    return data if is_distributed(data) else strategy.experimental_distribute_dataset(data)


def check_finite(data: Any, steps: int | None, what: str, steps_name: str) -> None:
    """An infinite dataset needs a step count (Keras raises the same): a stratagem Dataset, or a
    distributed one (``experimental_distribute_dataset`` / ``distribute_datasets_from_function``)
    over one, that says its cardinality is infinite."""
    if steps is not None:
        return
    if isinstance(data, Dataset):
        kind = "an infinite dataset"
    elif is_distributed(data) and callable(getattr(data, "cardinality", None)):
        kind = f"a distributed dataset ({type(data).__name__}) over an infinite dataset"
    else:
        return
    if data.cardinality() == INFINITE_CARDINALITY:
        raise ValueError(
            f"{what} is {kind} (e.g. .repeat() without a count) and {steps_name} is not set, so "
            f"the first epoch would never end; pass {steps_name}=N or make the dataset finite "
            "(.repeat(count) or no repeat)"
        )


class WholeBatches:
    """Every replica reads the whole global batches of ``data`` (placed on ``device``): under
    ``on_failure="continue"`` the survivors of a lost replica must be able to compute its share of
    the same batch. The first batch is compared across replicas (an unseeded shuffle would give
    each replica other batches: a clear error, not a silently different model)."""

    resumable = False

    def __init__(self, data: Any, strategy: Strategy, optimizer: Any = None) -> None:
        if is_distributed(data):
            raise TypeError(
                "FailureOptions(on_failure='continue') reads the global batches itself, so that the "
                "survivors of a lost replica can share its part of them: pass fit the dataset, not "
                "strategy.experimental_distribute_dataset(...) / distribute_datasets_from_function(...)"
            )
        self.data = data
        self.strategy = strategy
        self.optimizer = optimizer
        self._checked = False

    def iterator(self, epoch: int | None = None, seed: int | None = None) -> Iterator[Any]:
        if epoch is not None and isinstance(self.data, Dataset):
            source: Iterator[Any] = self.data.iterator(epoch=epoch, seed=seed)
        else:
            source = iter(self.data)
        device = self.strategy.extended.device
        for batch in source:
            batch = place(to_tensors(batch), device)
            if not self._checked:  # (checked once it is done: a failure in it leaves it to do again)
                _check_same_batch(self.strategy.extended.world, batch, optimizer_facts(self.optimizer))
                self._checked = True
            yield batch


def _take(it: Iterator[Any], n: int) -> list[Any]:
    """Up to ``n`` batches of ``it``: through its ``next_batches`` (one agreement for all) when
    it has one."""
    next_batches = getattr(it, "next_batches", None)
    if next_batches is not None:
        return next_batches(n)  # type: ignore[no-any-return]
    return list(itertools.islice(it, n))


def _check_same_batch(comm: Any, batch: Any, facts: FirstFacts | None = None) -> None:
    """A clear error unless every replica read the same first global batch (and, in the same
    check, has the same ``facts``: the optimizer's settings)."""
    digest = torch.tensor([facts.digest() if facts is not None else 0], dtype=torch.int64)
    try:
        comm.check_same_values(
            "fit's first global batch",
            (batch, digest),
            "the dataset gave different first global batches on different replicas; with "
            "FailureOptions(on_failure='continue') every replica reads the same global batches: seed "
            "any shuffling (e.g. DataLoader(..., generator=torch.Generator().manual_seed(0)))",
        )
    except ReplicaMismatchError:
        if facts is not None:  # the settings differ? say which (every replica is here)
            problem = facts.mismatch(comm.all_gather_object(dict(facts.values)))
            if problem is not None:
                raise ReplicaMismatchError(problem) from None
        raise


def optimizer_facts(optimizer: Any) -> FirstFacts | None:
    """The hyperparameters of every param group of ``optimizer`` (lr, betas, weight_decay,
    momentum, ...: everything but the parameters), as the first batch's vote compares them: a
    learning rate that differs per replica would let the replicas drift apart without a word."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        return None
    values = {"param groups": str(len(groups))}
    for i, group in enumerate(groups):
        for key, value in group.items():
            if key != "params":
                values[f"param group {i} {key}"] = _setting(value)
    return FirstFacts(
        f"the optimizer's settings ({type(optimizer).__name__})",
        values,
        "build the optimizer with the same settings on every replica (a learning rate computed from "
        "the rank or read from a per-worker config makes the replicas train apart); to scale it by the "
        "number of replicas, use strategy.num_replicas_in_sync, which every replica shares",
    )


def _setting(value: Any) -> str:
    """A hyperparameter as comparable text (a tensor learning rate by its value)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    if isinstance(value, tuple):
        return repr(tuple(v.item() if isinstance(v, torch.Tensor) else v for v in value))
    return repr(value)


class GlobalBatches:
    """Epochs of this replica's batches from ``data`` (via ``strategy``) with a saveable position.
    ``whole``: every replica gets the whole global batches (``WholeBatches``). ``optimizer``: its
    hyperparameters are compared across replicas with each pass's first batch (``agree_first``)."""

    def __init__(
        self, strategy: Strategy, data: Any, steps_per_epoch: int | None, *, whole: bool = False,
        optimizer: Any = None,
    ) -> None:  # fmt: skip
        check_iterable(data, "data")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be a positive number of steps or None, got {steps_per_epoch}")
        check_finite(data, steps_per_epoch, "data", "steps_per_epoch")
        self.data = data
        self.optimizer = optimizer
        self.dist = WholeBatches(data, strategy, optimizer) if whole else distributed(strategy, data)
        self.steps_per_epoch = steps_per_epoch
        self.resumable = bool(self.dist.resumable)
        # whether a job with another number of replicas can take over this position by replaying
        # the pass (global batches, the same whatever their split; not a pipeline per replica)
        self.replayable = whole or (
            not is_distributed(data) and not (isinstance(data, Dataset) and shards_by_files(data))
        )
        self._it: Iterator[Any] | None = None
        self._pass = -1
        self._consumed = 0  # batches taken from the current pass
        self._epoch_step = 0  # batches taken in the current epoch

    def steps(self) -> int | None:
        """Steps per epoch when known (for progress bars)."""
        n = known_length(self.data)
        if self.steps_per_epoch is None:
            return n
        return self.steps_per_epoch if n is None else min(n, self.steps_per_epoch)

    def _new_pass(self) -> None:
        self._pass += 1
        self._consumed = 0
        self._it = self.dist.iterator(epoch=self._pass)
        agree = getattr(self._it, "agree_first", None)  # a distributed dataset's iterator
        if agree is not None:
            agree(optimizer_facts(self.optimizer))

    def begin_epoch(self) -> None:
        """Start an epoch: a fresh pass, or (with steps_per_epoch) go on with the current one."""
        self._epoch_step = 0
        if self.steps_per_epoch is None or self._it is None:
            self._new_pass()

    def take(self, n: int) -> list[Any]:
        """Up to ``n`` of the current epoch's next batches (fewer at its end, none after it): an
        execution's batches, agreed on by the replicas in one vote where the iterator can
        (``next_batches``), else batch by batch."""
        out: list[Any] = []
        restarted = False
        while len(out) < n and self._it is not None:
            want = n - len(out)
            if self.steps_per_epoch is not None:
                want = min(want, self.steps_per_epoch - self._epoch_step)
                if want <= 0:
                    break
            got = _take(self._it, want)
            self._consumed += len(got)
            self._epoch_step += len(got)
            out += got
            if len(got) < want:  # the pass ended
                self._it = None
                if self.steps_per_epoch is not None and self._epoch_step == 0 and not restarted:
                    restarted = True  # the pass ended exactly at the last epoch's end
                    self._new_pass()
        return out

    # --- position ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "pass": self._pass,
            "consumed": self._consumed,
            "epoch_step": self._epoch_step,
            "exhausted": self._it is None,
            "replayable": self.replayable,
        }
        if self.resumable and self._it is not None:
            state["iterator"] = self._it.state_dict()  # type: ignore[attr-defined]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pass = int(state["pass"])
        self._consumed = int(state["consumed"])
        self._epoch_step = int(state["epoch_step"])
        if state.get("exhausted") or self._pass < 0:
            self._it = None
            return
        if self.resumable and "iterator" in state:
            self._it = self.dist.iterator_from_state(state["iterator"])  # type: ignore[union-attr]
            return
        self._it = self.dist.iterator(epoch=self._pass, seed=state.get("seed"))
        for _ in range(self._consumed):
            if next(self._it, _END) is _END:
                raise RuntimeError(
                    f"cannot resume: pass {self._pass} over the data ended after fewer than the "
                    f"{self._consumed} batches already consumed; the data must give the same "
                    "batches when iterated again"
                )

    @staticmethod
    def reshard_state(states: list[dict[str, Any]], world: int) -> dict[str, Any]:
        """The position for a job of ``world`` replicas from the positions saved by another
        number: the pass is replayed from its start (with its seed, so unseeded shuffles repeat)
        and the global batches consumed are skipped. A pipeline's own state is never carried
        over: its shape depends on the number of replicas (each replica's share of a batch)."""
        if not all(s.get("replayable", False) for s in states):
            raise ValueError(
                f"the backup was made by {len(states)} replicas each reading its own files or "
                f"pipeline (a Dataset auto-sharded by files, or a distributed dataset passed to "
                f"fit), so which examples a replica reads depends on their number: it cannot resume "
                f"on {world}. Resume with {len(states)} replicas, or shard by examples (options = "
                "Options(); options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA; "
                "dataset = dataset.with_options(options))"
            )
        first = states[0]
        out = {k: v for k, v in first.items() if k != "iterator"}
        source = first.get("iterator", {}).get("source")  # a stratagem Dataset iterator's state
        if isinstance(source, dict) and source.get("seed") is not None:
            out["seed"] = int(source["seed"])
        if isinstance(source, dict) and source.get("loader"):  # a sharded DataLoader's position:
            out["iterator"] = first["iterator"]  # global (pass, seed, batches), whatever the split
        return out


_END: Any = object()
