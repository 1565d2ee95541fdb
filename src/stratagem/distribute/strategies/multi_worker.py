"""MultiWorkerMirroredStrategy: mirrored variables across every replica of every worker.

One process per replica on every machine of a cluster a resolver describes (TF_CONFIG, torchrun,
Slurm, or given by hand). It composes the same DataParallelExtended as MirroredStrategy, so
semantics and parity are the same; what it adds is the cluster: it connects through the
resolver, checks the workers agree on its configuration, and shards stratagem Datasets across
the workers (auto-shard), rebatching each global batch to per-replica batches.
"""

from __future__ import annotations

import dataclasses
from typing import final

import torch

from stratagem.cluster.resolvers import ClusterResolver, detect
from stratagem.comm.failure import FailureOptions
from stratagem.distribute.bootstrap import (
    CommunicationImplementation,
    CommunicationOptions,
    check_agreement,
    connect_to_cluster,
    default_device,
    local_facts,
)
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.reduce_op import ReduceOp
from stratagem.distribute.strategy import Strategy

__all__ = ["CommunicationImplementation", "CommunicationOptions", "MultiWorkerMirroredStrategy"]


@final
class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over every process of a cluster (one replica per process).

    ``cluster_resolver`` defaults to ``cluster_resolver.detect()`` (TF_CONFIG, torchrun, Slurm,
    else a job of one process). ``communication_options`` (TF's ``CommunicationOptions``) picks the
    backend (``implementation``: AUTO, NCCL: GPU replicas on nccl, RING: CPU replicas on gloo),
    bounds every collective (``timeout_seconds``) and sets the gradient bucket size
    (``bytes_per_pack``). ``gradient_reduction`` as in MirroredStrategy (SUM: scale the loss with
    ``compute_average_loss``). Workers started with different options stop here with an error
    naming the worker. ``devices``: None (a GPU per process when the machine has one for each,
    else the CPU), ``"cpu"`` or ``"cuda"``.

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
        devices: str | None = None,
        failure: FailureOptions | None = None,
    ) -> None:
        resolver = cluster_resolver if cluster_resolver is not None else detect()
        spec = resolver.cluster_spec()
        options = communication_options or CommunicationOptions()
        if failure is not None:  # the same as CommunicationOptions(failure=...)
            options = dataclasses.replace(options, failure=failure)
        device = default_device(spec, options.devices(devices, torch.cuda.device_count(), "MultiWorkerMirroredStrategy"))
        comm = connect_to_cluster(resolver, options, device=device)
        op = ReduceOp.of(gradient_reduction)
        config = {"strategy": "MultiWorkerMirroredStrategy", "gradient_reduction": op.value,
                  "options": repr(options)}
        if comm.world_size > 1:
            check_agreement(comm, spec, local_facts(spec, config), "MultiWorkerMirroredStrategy")
        self.cluster_resolver = resolver
        self.cluster_spec = spec
        self.communication_options = options
        self.device = device
        super().__init__(
            DataParallelExtended(
                comm,
                device,
                gradient_op=op.value,
                first_bucket_bytes=options.first_bucket_bytes,
                bucket_bytes=options.bucket_bytes,
                name="MultiWorkerMirroredStrategy",
                failure=options.failure,
            )
        )
