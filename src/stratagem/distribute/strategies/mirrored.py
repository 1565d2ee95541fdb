"""MirroredStrategy: N replicas on one machine, one process each, gradients all-reduced.

A plain ``python train.py`` that builds ``MirroredStrategy(num_replicas=2)`` starts the other
replica itself (re-running the script); under torchrun or ``stratagem run`` it joins the job the
launcher made. CPU replicas use gloo, CUDA replicas NCCL.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import final

from stratagem.comm.failure import FailureOptions
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.reduce_op import ReduceOp
from stratagem.distribute.startup import start
from stratagem.distribute.strategy import Strategy


@final
class MirroredStrategy(Strategy):
    """Synchronous data parallelism over ``devices`` or ``num_replicas`` processes on this machine.

    ``devices``: None (every visible GPU, one replica each, else one CPU replica), ``"cpu"``
    (``num_replicas`` CPU replicas, gloo), ``"cuda"`` (one replica per GPU, NCCL) or a list
    (``["cuda:0", "cuda:1"]``, ``["cpu"] * 4``). More replicas than GPUs is an error naming
    ``devices="cpu"``: two replicas never share one GPU.

    ``gradient_reduction=ReduceOp.SUM`` (tf.distribute's contract: scale the loss with
    ``compute_average_loss``); ``ReduceOp.MEAN`` opts in to DDP's averaging of gradients, for
    losses that are per-replica means. ``timeout`` bounds every collective (seconds).
    ``failure``: how a failed replica is found and what follows (``FailureOptions``; with
    ``on_failure="continue"``, ``fit`` goes on without a lost replica: docs/FAILOVER.md).
    """

    def __init__(
        self,
        devices: str | Sequence[str] | None = None,
        *,
        num_replicas: int | None = None,
        gradient_reduction: ReduceOp | str = ReduceOp.SUM,
        timeout: float = 120.0,
        bucket_cap_mb: float = 25.0,
        failure: FailureOptions | None = None,
    ) -> None:
        _check_arguments(num_replicas, timeout, bucket_cap_mb)
        replicas = None if num_replicas is None else int(num_replicas)
        started = start("MirroredStrategy", devices, timeout=float(timeout), replicas=replicas, failure=failure)
        spec, device, comm = started.spec, started.device, started.comm
        self.cluster_spec = spec
        self.device = device
        self.devices = started.devices
        op = ReduceOp.of(gradient_reduction).value
        super().__init__(
            DataParallelExtended(
                comm,
                device,
                gradient_op=op,
                bucket_bytes=int(bucket_cap_mb * 1024 * 1024),
                name="MirroredStrategy",
                failure=failure,
                # tf's MirroredStrategy is one process holding every replica of the machine:
                # experimental_local_results gives all of their parts
                local_replicas=range(first := spec.rank - spec.local_rank, first + spec.local_world_size),
            )
        )


def _check_arguments(num_replicas: object, timeout: object, bucket_cap_mb: object) -> None:
    """Clear errors for arguments of the wrong kind (``num_replicas="2"``), before anything starts."""
    if num_replicas is not None and (isinstance(num_replicas, bool) or not isinstance(num_replicas, numbers.Integral)):
        whole = isinstance(num_replicas, (str, float)) and _whole(num_replicas)
        hint = f"; use num_replicas={int(float(num_replicas))}" if whole else ""  # type: ignore[arg-type]
        raise TypeError(
            f"MirroredStrategy(num_replicas=...) takes a whole number of replicas (an int >= 1) or None, "
            f"got {num_replicas!r} ({type(num_replicas).__name__}){hint}"
        )
    for name, value in (("timeout", timeout), ("bucket_cap_mb", bucket_cap_mb)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
            raise ValueError(f"MirroredStrategy({name}=...) takes a number > 0, got {value!r} ({type(value).__name__})")


def _whole(value: str | float) -> bool:
    try:
        return float(value).is_integer() and float(value) >= 1
    except ValueError:
        return False
