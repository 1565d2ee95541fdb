"""MultiWorkerMirroredStrategy: mirrored variables across every replica of every worker.

One process per replica on every machine of a cluster a resolver describes (TF_CONFIG, torchrun,
Slurm, or given by hand). It composes the same DataParallelExtended as MirroredStrategy, so
semantics and parity are the same; what it adds is the cluster: it connects through the
resolver, checks the workers agree on its configuration, and shards stratagem Datasets across
the workers (auto-shard), rebatching each global batch to per-replica batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, final

import torch

from stratagem.cluster.resolvers import ClusterResolver, ClusterSpec, detect
from stratagem.distribute.bootstrap import (
    CommunicationOptions,
    check_agreement,
    connect_to_cluster,
    default_device,
    local_facts,
)
from stratagem.distribute.data_parallel import DataParallelExtended
from stratagem.distribute.input import InputContext, PerReplicaDatasets
from stratagem.distribute.reduce_op import ReduceOp
from stratagem.distribute.strategy import Strategy

__all__ = ["CommunicationOptions", "MultiWorkerMirroredStrategy", "shard_for_replica"]


def _last_batch(dataset: Any) -> Any:
    from stratagem.data.batching import BatchDataset

    node = dataset
    while node is not None:
        if isinstance(node, BatchDataset):
            return node
        node = node._inputs[0] if len(node._inputs) == 1 else None
    return None


def _replace(dataset: Any, target: Any, make: Callable[[Any], Any]) -> Any:
    if dataset is target:
        return make(dataset)
    inputs = tuple(_replace(i, target, make) for i in dataset._inputs)
    if any(a is not b for a, b in zip(inputs, dataset._inputs)):
        return dataset._with_inputs(inputs)
    return dataset


def shard_for_replica(dataset: Any, num_replicas: int, replica: int) -> Any | None:
    """This replica's pipeline: global batches of B rebatched to B / num_replicas, then auto-sharded.

    Returns None when the pipeline cannot be sharded that way (it does not batch, or its policy
    is OFF); the caller then splits global batches instead. A ValueError when B is not divisible.
    """
    from stratagem.data import AutoShardPolicy, auto_shard

    if dataset.options().resolved_auto_shard_policy == AutoShardPolicy.OFF:
        return None
    batch = _last_batch(dataset)
    if batch is None:
        return None
    size = batch.batch_size
    if size % num_replicas:
        raise ValueError(
            f"global batch {size} is not divisible by {num_replicas} replicas; use a multiple of "
            f"{num_replicas}, or set Options().distribute.auto_shard_policy = AutoShardPolicy.OFF "
            "to have every worker read every batch and split it"
        )

    def rebatch(b: Any) -> Any:
        import copy

        clone = copy.copy(b)
        clone.batch_size = size // num_replicas
        return clone

    return auto_shard(_replace(dataset, batch, rebatch), num_replicas, replica)


def _is_stratagem_dataset(dataset: Any) -> bool:
    try:
        from stratagem.data import Dataset
    except ImportError:  # pragma: no cover - data layer always present in a full install
        return False
    return isinstance(dataset, Dataset)


class _MultiWorkerExtended(DataParallelExtended):
    """DataParallelExtended plus cluster facts and auto-sharded input."""

    def __init__(self, spec: ClusterSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cluster_spec = spec

    @property
    def should_checkpoint(self) -> bool:
        return self.comm.rank == 0

    def distribute_dataset(self, dataset: Iterable[Any], options: Any) -> Iterable[Any]:
        n = self.num_replicas_in_sync
        if n > 1 and _is_stratagem_dataset(dataset):
            mine = shard_for_replica(dataset, n, self.replica_id)
            if mine is not None:
                return PerReplicaDatasets(lambda _ctx: mine, self.comm, self._device, n)
        return super().distribute_dataset(dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: Any
    ) -> Iterable[Any]:
        return super().distribute_datasets_from_function(dataset_fn, options)


@final
class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over every process of a cluster (one replica per process).

    ``cluster_resolver`` defaults to ``cluster_resolver.detect()`` (TF_CONFIG, torchrun, Slurm,
    else a job of one process). ``communication_options`` bounds every collective and sets the
    gradient bucket size. ``gradient_reduction`` as in MirroredStrategy (SUM: scale the loss with
    ``compute_average_loss``). Workers started with different options stop here with an error
    naming the worker.

    ``experimental_distribute_dataset`` takes global batches. A stratagem Dataset that ends in
    ``batch(B)`` is rebatched to ``B / replicas`` and auto-sharded (FILE or DATA policy), so each
    worker reads only its share; other iterables are read whole by every worker and split.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        *,
        gradient_reduction: ReduceOp | str = ReduceOp.SUM,
    ) -> None:
        resolver = cluster_resolver if cluster_resolver is not None else detect()
        spec = resolver.cluster_spec()
        options = communication_options or CommunicationOptions()
        device = default_device(spec)
        if device.type == "cpu" and spec.local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.local_world_size))
        comm = connect_to_cluster(resolver, options, device=device)
        op = ReduceOp.of(gradient_reduction)
        config = {"strategy": "MultiWorkerMirroredStrategy", "gradient_reduction": op.value,
                  "options": repr(options)}
        if comm.world_size > 1:
            check_agreement(comm, spec, local_facts(spec, config), "MultiWorkerMirroredStrategy")
        self.cluster_resolver = resolver
        self.communication_options = options
        self.device = device
        super().__init__(
            _MultiWorkerExtended(
                spec,
                comm,
                device,
                gradient_op=op.value,
                bucket_bytes=int(options.bucket_cap_mb * 1024 * 1024),
                name="MultiWorkerMirroredStrategy",
            )
        )
