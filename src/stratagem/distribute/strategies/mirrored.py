"""MirroredStrategy: N replicas on one machine, one process each, gradients all-reduced.

A plain ``python train.py`` that builds ``MirroredStrategy(num_replicas=2)`` starts the other
replica itself (re-running the script); under torchrun or ``stratagem run`` it joins the job the
launcher made. CPU replicas use gloo, CUDA replicas NCCL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import torch

from stratagem.cluster import ClusterSpec, ensure_replicas
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.join import join, local_device
from stratagem.distribute.reduce_op import ReduceOp
from stratagem.distribute.strategy import Strategy


def _resolve_devices(devices: Sequence[str] | None, num_replicas: int | None) -> list[torch.device] | None:
    if devices is not None:
        devs = [torch.device(d) for d in devices]
        if not devs:
            raise ValueError("MirroredStrategy(devices=[]) needs at least one device")
        if num_replicas is not None and num_replicas != len(devs):
            raise ValueError(f"devices={list(devices)} gives {len(devs)} replicas but num_replicas={num_replicas}")
        for d in devs:
            if d.type == "cuda" and (not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count()):
                raise ValueError(
                    f"device {d} is not available (this machine has {torch.cuda.device_count()} GPUs)"
                )
        return devs
    return None


@final
class MirroredStrategy(Strategy):
    """Synchronous data parallelism over ``devices`` or ``num_replicas`` processes on this machine.

    ``gradient_reduction=ReduceOp.SUM`` (tf.distribute's contract: scale the loss with
    ``compute_average_loss``); ``ReduceOp.MEAN`` opts in to DDP's averaging of gradients, for
    losses that are per-replica means. ``timeout`` bounds every collective (seconds).
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        *,
        num_replicas: int | None = None,
        gradient_reduction: ReduceOp | str = ReduceOp.SUM,
        timeout: float = 120.0,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        if num_replicas is not None and num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        devs = _resolve_devices(devices, num_replicas)
        launched = ClusterSpec.from_environ()
        if devs is not None:
            count: int | None = len(devs)
        elif num_replicas is not None:
            count = num_replicas
        elif launched is not None:
            count = launched.world_size
        else:
            count = max(torch.cuda.device_count(), 1)
        if devs is None and launched is None and count is not None:
            gpus = torch.cuda.device_count()
            if gpus:
                if count > gpus:
                    raise ValueError(f"num_replicas={count} but this machine has {gpus} GPUs")
                devs = [torch.device("cuda", i) for i in range(count)]
        spec = ensure_replicas(count)
        device = local_device(spec.local_rank, devs)
        self.cluster_spec = spec
        self.device = device
        comm = join(spec, device, timeout=timeout)
        op = ReduceOp.of(gradient_reduction).value
        super().__init__(
            DataParallelExtended(
                comm,
                device,
                gradient_op=op,
                bucket_bytes=int(bucket_cap_mb * 1024 * 1024),
                name="MirroredStrategy",
            )
        )
