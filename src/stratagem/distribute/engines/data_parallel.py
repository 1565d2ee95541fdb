"""DataParallelExtended: replicas of one model, one per process, kept identical (mirrored).

The engine behind the default, one-device, mirrored and multi-worker strategies. It composes a
Communicator (the replicas), a device (where this replica computes) and a MirrorRegistry (what
the scope created); the strategies differ only in how they build these.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stratagem import data
from stratagem.comm import Communicator
from stratagem.comm.failure import FailureOptions
from stratagem.core import tree
from stratagem.core.batches import place, to_tensors
from stratagem.core.eager import eager_only
from stratagem.distribute import context
from stratagem.distribute.determinism import op_determinism
from stratagem.distribute.engines import loader
from stratagem.distribute.engines.device_feed import feed, feeds
from stratagem.distribute.engines.input import (
    DistributedDataset,
    PerReplicaDatasets,
    ShardedDataset,
)
from stratagem.distribute.engines.mirror import MirrorRegistry
from stratagem.distribute.engines.piecewise import PiecewiseRun
from stratagem.distribute.reduce_op import ReduceOp
from stratagem.distribute.strategy import ReplicaContext, StrategyExtended


def _to_cpu(x: Any) -> Any:
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _leaf_tensor(x: Any) -> torch.Tensor:
    t = to_tensors(x)
    if isinstance(t, torch.Tensor):
        return t
    return torch.as_tensor(t)


_OURS = ("stratagem.distribute", "stratagem.comm", "stratagem.core")


def call_site() -> tuple[str, int]:
    """The file and line that called into the Strategy API (the first frame outside it): the
    same on every replica of an SPMD program, so checks keyed by it are decided alike."""
    frame = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(_OURS):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return ("?", 0)
    return (frame.f_code.co_filename, frame.f_lineno)


def _where(site: Any) -> str:
    return f"{site[0]}:{site[1]}" if isinstance(site, tuple) and len(site) == 2 else "?"


def _masked(tensors: list[torch.Tensor], axis: int) -> list[torch.Tensor]:
    """Shape-only stand-ins with the size along ``axis`` hidden (it may differ by replica)."""
    return [
        torch.empty([0 if t.dim() and d == axis % t.dim() else n for d, n in enumerate(t.shape)], dtype=t.dtype, device="meta")
        for t in tensors
    ]


class DataParallelExtended(StrategyExtended):
    """N replicas (processes) of one model over a Communicator."""

    def __init__(
        self,
        comm: Communicator,
        device: torch.device | None,
        *,
        mirror: bool = True,
        gradient_op: str = "sum",
        sync_buffers: bool = True,
        first_bucket_bytes: int | None = None,
        bucket_bytes: int | None = None,
        name: str = "strategy",
        local_replicas: Sequence[int] | None = None,
        failure: FailureOptions | None = None,
    ) -> None:
        self.comm = comm
        #: how failures are found and what follows them (``on_failure="continue"``: fit goes on)
        self.failure = failure
        #: strategy.run in the deterministic mode (made at its first use)
        self._piecewise: PiecewiseRun | None = None
        self._device = device
        self.name = name
        # the replicas (ranks of ``comm``) whose parts tf's one process would hold: this
        # machine's under MirroredStrategy; None: this process's replica only
        self.local_replicas = tuple(local_replicas) if local_replicas is not None else None
        self.sync_buffers = sync_buffers
        self.registry: MirrorRegistry | None = (
            MirrorRegistry(
                comm,
                device,
                gradient_op=gradient_op,
                first_bucket_bytes=first_bucket_bytes,
                bucket_bytes=bucket_bytes,
                strategy_name=name,
                owner=self.owner,
            )
            if mirror
            else None
        )

    # --- facts ------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self.comm.world_size

    @property
    def replica_id(self) -> int:
        return self.comm.rank

    @property
    def device(self) -> torch.device | None:
        return self._device

    @property
    def should_checkpoint(self) -> bool:
        return self.comm.rank == 0

    @property
    def world(self) -> Communicator:
        return self.comm

    @property
    def requires_scope(self) -> bool:
        return self.registry is not None

    def barrier(self) -> None:
        self.comm.barrier()

    def rejoined(self) -> None:
        """This process was let into a running job (``on_failure="continue"``): the mirrored
        state's per-step lists made as the others have them (values come from a live peer)."""
        if self.registry is not None:
            self.registry.rejoined()

    def members_changed(self) -> None:
        """Every member, at the same point, after the job's members changed (a replica lost or
        let in): the gradient buckets are planned again at the next reducing pass, together."""
        reducer = self.registry.reducer if self.registry is not None else None
        if reducer is not None:
            reducer.relearn()

    def merge_values(self, value: Any) -> list[Any]:
        return self.comm.all_gather_object(tree.map_structure(_to_cpu, value))

    def local_results(self, value: Any) -> tuple[Any, ...]:
        local = self.local_replicas
        if local is None or self.comm.world_size == 1:
            return (value,)
        site = call_site()
        everyone = self.comm.all_gather_object(("experimental_local_results", site, tree.map_structure(_to_cpu, value)))
        calls = [(e[0], e[1]) if isinstance(e, tuple) and len(e) == 3 else ("?", None) for e in everyone]
        if any(c != calls[0] for c in calls):
            where = "; ".join(f"replica {r}: {c[0]} at {_where(c[1])}" for r, c in enumerate(calls))
            raise RuntimeError(
                f"{self.name}.experimental_local_results gathers every local replica's part, so "
                f"every replica must call it at the same point of the program ({where}); call "
                "it on every replica (not inside `if strategy.is_chief:`), then print or keep "
                "the parts on the chief only"
            )
        mine = self.comm.rank
        return tuple(value if r == mine else place(everyone[r][2], self._device) for r in local)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        reducer = self.registry.reducer if self.registry is not None else None
        if reducer is None:
            yield
            return
        was, reducer.enabled = reducer.enabled, False
        try:
            yield
        finally:
            reducer.enabled = was

    # --- scope and run ----------------------------------------------------------------------
    def scope(self) -> contextlib.AbstractContextManager[None]:
        return self.registry.capture() if self.registry is not None else contextlib.nullcontext()

    def call_for_replica(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        args, kwargs, ctx = self._prepare_call(fn, args, kwargs)
        mode = op_determinism()
        with context.replica_scope(ctx), self._run_checks():
            if mode is not None and self.registry is not None and (args or kwargs):
                # the deterministic mode: the step once per piece, the gradients summed by one tree
                if self._piecewise is None:
                    reg = self.registry
                    self._piecewise = PiecewiseRun(self.comm, self._device, reg.trainable, reg.batch_norms_training)
                with self.no_sync():
                    return self._piecewise(mode, args, kwargs, lambda a, k: fn(*a, **k))
            return fn(*args, **kwargs)

    def _prepare_call(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[Sequence[Any], dict[str, Any], ReplicaContext]:
        """The host-side work before a replica's step (eager in a compiled caller): the inputs
        placed on the device, the modules checked, buffers synced, the replica context."""
        args = place(args, self._device)
        placed: dict[str, Any] = place(dict(kwargs), self._device)
        reg = self.registry
        if reg is not None:
            for v in (getattr(fn, "__self__", None), *args, *placed.values()):
                if isinstance(v, nn.Module):
                    reg.check_module(v)
            if self.sync_buffers:
                reg.sync_buffers()
        return args, placed, ReplicaContext(self.owner(), self.comm.rank)

    def _run_checks(self) -> contextlib.AbstractContextManager[None]:
        """While ``run`` executes: refuse modules and optimizers made outside the scope."""
        return self.registry.checking() if self.registry is not None else contextlib.nullcontext()

    # --- reductions -------------------------------------------------------------------------
    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        return self.comm.all_reduce(value, op.value, check=True, site=call_site())

    def reduce(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        leaves, treedef = tree.flatten(value)
        tensors = [_leaf_tensor(x).to(self._device) if self._device else _leaf_tensor(x) for x in leaves]
        site = call_site()
        if axis is None:
            out = self.comm.all_reduce(tensors, op.value, check=True, site=site)
            return tree.unflatten(treedef, out)
        self.comm.check_same_once("reduce", _masked(tensors, axis), site)
        sums = []
        counts = []
        for t in tensors:
            if t.dim() == 0:
                raise ValueError(f"cannot reduce a scalar along axis {axis}; use axis=None")
            sums.append(t.sum(dim=axis))
            counts.append(torch.tensor(t.shape[axis], dtype=torch.int64, device=t.device))
        total_sums, total_counts = self.comm.all_reduce((sums, counts), "sum", check=False)
        if op is ReduceOp.SUM:
            return tree.unflatten(treedef, total_sums)
        means = [
            s / c.clamp(min=1) if s.is_floating_point() else torch.div(s, c.clamp(min=1), rounding_mode="floor")
            for s, c in zip(total_sums, total_counts)
        ]
        return tree.unflatten(treedef, means)

    def gather(self, value: Any, axis: int) -> Any:
        leaves, treedef = tree.flatten(value)
        tensors = [_leaf_tensor(x) for x in leaves]
        self.comm.check_same("gather", _masked(tensors, axis))
        for t in tensors:
            if t.dim() == 0:
                raise ValueError("gather needs tensors with at least one dimension")
        return tree.unflatten(treedef, [self.comm.gather_varlen(t, axis % t.dim()) for t in tensors])

    # --- input ------------------------------------------------------------------------------
    def distribute_dataset(self, dataset: Iterable[Any], options: Any) -> Iterable[Any]:
        """Global batches split across replicas.

        A stratagem Dataset ending in ``batch(B)`` (B divisible by the replicas, auto-shard
        policy not OFF) is rebatched to ``B / N`` and auto-sharded, so each replica's pipeline
        reads only its share; a map-style torch DataLoader is sharded by its batch sampler
        (``engines.loader``); anything else is read whole by every replica and split. On a GPU
        the batches are copied to it ahead of need (``InputOptions.experimental_fetch_to_device``).
        """
        n = self.num_replicas_in_sync
        place_on = None if feeds(self._device, options) else self._device  # the feed places them
        out: Any = None
        if n > 1 and isinstance(dataset, data.Dataset):
            mine = data.rebatch_and_shard(dataset, n, self.replica_id)
            if mine is not None:
                batch = data.last_batch(dataset)
                drop = bool(batch is not None and batch.drop_remainder)
                out = ShardedDataset(mine, self.comm, place_on, drop_remainder=drop)
        if n > 1 and loader.shards(dataset):  # a DataLoader: each replica fetches its share
            out = loader.ShardedLoader(dataset, self.comm, place_on)  # type: ignore[arg-type]
        if out is None:
            out = DistributedDataset(dataset, self.comm, place_on)
        return feed(out, self._device, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any
    ) -> Iterable[Any]:
        place_on = None if feeds(self._device, options) else self._device
        out = PerReplicaDatasets(dataset_fn, self.comm, place_on, self.num_replicas_in_sync)
        return feed(out, self._device, options)


eager_only(DataParallelExtended, ["_prepare_call"])
