"""ShardedExtended: one model sharded over every process with torch's ``fully_shard`` (ZeRO-3).

What the scope builds is built on the host as on one device (or, with ``init="meta"``, on the
meta device: ``build``); when the scope closes, each outermost module is split into units (``shard_plan``), ``fully_shard`` is applied to the units
and then the root over a 1-D DeviceMesh of the job (with ``shard_size``, a 2-D (replicate,
shard) mesh: HSDP), and every process keeps its shard of each parameter, equal to what one
device builds. Parameters are DTensors sharded on dim 0; FSDP
all-gathers a unit before its forward and backward and reduce-scatters its gradients (summed,
tf.distribute's contract with ``compute_average_loss``, unless ``gradient_op="mean"``), and the
optimizer, created over the sharded parameters, keeps its state with each shard.

Replicas are data-parallel: the batch is split across processes as under MirroredStrategy, so
reductions, gathers and distributed datasets are the data-parallel engine's, composed here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.comm import Communicator
from stratagem.comm.failure import collectives_explained
from stratagem.comm.mesh import JobMesh
from stratagem.core.mesh import DATA_SHARD, DeviceMesh
from stratagem.distribute.engines.build import ShardedBuild, retarget_optimizer
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.engines.fsdp import ShardedRoots, ShardingOptions, apply_fsdp
from stratagem.distribute.engines.meta_init import allocated_keeping_buffers
from stratagem.distribute.engines.over_replicas import OverReplicas
from stratagem.distribute.engines.shard_plan import UnitPlan
from stratagem.distribute.strategy import StateLayout, Strategy


def sharded_layout(n: int, shard_size: int | None) -> DeviceMesh:
    """The processes of a sharded job of ``n``: sharded over all of them, or (HSDP,
    ``shard_size``) within groups of ``shard_size`` consecutive ranks and replicated across the
    groups; a ValueError for a ``shard_size`` that does not divide ``n``."""
    if shard_size is not None and (shard_size < 1 or n % shard_size):
        raise ValueError(
            f"shard_size={shard_size} must divide the {n} processes (groups of "
            f"shard_size processes each hold one sharded copy)"
        )
    return DeviceMesh.of((DATA_SHARD, n)).with_hsdp(DATA_SHARD, shard_size)


class ShardedExtended(OverReplicas):
    """Every process holds 1/N of each parameter, its gradient and its optimizer state."""

    def __init__(self, job: JobMesh, options: ShardingOptions, *, name: str, init: str = "auto") -> None:
        if options.gradient_op not in ("sum", "mean"):
            raise ValueError(f"gradient_op must be 'sum' or 'mean', got {options.gradient_op!r}")
        self.job = job  # its layout: sharded_layout(N, options.shard_size)
        self.comm = comm = job.world
        self._device = device = job.device
        self.options = options
        self.name = name
        self._dp = DataParallelExtended(comm, device, mirror=False, name=name)
        self.build = ShardedBuild(comm, device, name, self._shard, self.owner, init)
        self.plans: list[UnitPlan] = []
        self.roots = ShardedRoots()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return retarget_optimizer(optimizer)

    def bind(self, strategy: Strategy) -> None:
        super().bind(strategy)
        self._dp.bind(strategy)

    @property
    def mesh(self) -> Any:
        """The DeviceMesh the parameters are sharded over."""
        return self.job.torch

    @property
    def layout(self) -> DeviceMesh:
        return self.job.layout

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
        return True  # every process holds a part no other process has

    @property
    def world(self) -> Communicator:
        return self.comm

    @property
    def requires_scope(self) -> bool:
        return True

    @property
    def state_layout(self) -> StateLayout:
        return StateLayout.SHARDED

    def barrier(self) -> None:
        self.comm.barrier()

    # --- scope: build on meta, then shard and initialise ------------------------------------
    def scope(self) -> contextlib.AbstractContextManager[None]:
        return self.build.scope()

    def _shard(self, root: nn.Module, materialized: bool) -> None:
        # built on meta: real (empty) storage once sharded, initialised by the replay after
        with allocated_keeping_buffers(root, self._device) if not materialized else contextlib.nullcontext():
            self.plans.append(apply_fsdp(root, self.mesh, self.options))
        self.roots.add(root)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.roots.no_sync()

    # --- run ----------------------------------------------------------------------------------
    def call_for_replica(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        self.build.check_call(fn, args, kwargs)
        # FSDP2 gathers and reduce-scatters on the group itself: a peer lost in one of them is
        # named as in the job's own collectives
        with collectives_explained(self._dp.comm, "a sharded gather or reduce-scatter"):
            return self._dp.call_for_replica(fn, args, kwargs)
