"""ShardedStrategy: ZeRO-3 data parallelism on torch's ``fully_shard`` (FSDP2), one process per replica.

Like MirroredStrategy (a plain script starts its other replicas itself; under torchrun or
``stratagem run`` it joins the job), but each process keeps only 1/N of every parameter, of its
gradient and of its optimizer state, so models N times larger than one device fit.
"""

from __future__ import annotations

from typing import Any, final

from stratagem.distribute.engines.build import check_init
from stratagem.distribute.engines.fsdp import ShardingOptions
from stratagem.distribute.engines.shard_plan import UnitSpec
from stratagem.distribute.engines.sharded import ShardedExtended, sharded_layout
from stratagem.distribute.reduce_op import ReduceOp
from stratagem.distribute.startup import start
from stratagem.distribute.strategy import Strategy


@final
class ShardedStrategy(Strategy):
    """Modules created in ``scope()`` are sharded over ``num_replicas`` processes as they are built.

    ``units``: which submodules are all-gathered together (None: the blocks of the outermost
    ``ModuleList``/``Sequential``, else units of >= 1/8 of the parameters; a class or tuple of
    classes; or a minimum parameter count). ``reshard_after_forward``: None (the default, as
    ``fully_shard``'s): free each unit's gathered parameters after its forward (ZeRO-3) but keep
    the root's, which backward gathers again at once; True: the root's too; False: keep every
    unit's until its backward (ZeRO-2-like, more memory, less traffic).
    ``mixed_precision``: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (e.g. parameters in
    bf16, reductions in fp32). ``offload``: ``True`` or a ``CPUOffloadPolicy`` keeps parameters,
    gradients and optimizer state on the CPU. ``gradient_reduction=ReduceOp.SUM`` is
    tf.distribute's contract (scale the loss with ``compute_average_loss``); ``MEAN`` averages
    like FSDP's default. ``shard_size``: shard each copy over groups of that many consecutive
    processes and replicate it across the groups (HSDP: gradients reduce-scattered within a
    group, all-reduced across groups); None shards over all.

    ``init``: how the scope builds the model. ``"auto"`` (default) and ``"materialize"`` build it
    on the host exactly as on one device (its own initialisation included), then shard it and
    free the full copy: the peak while building is one full copy of the model per process.
    ``"meta"`` builds on the meta device and initialises each shard by replaying the modules'
    ``reset_parameters()``, so no process ever holds the whole model; for models whose every
    parameter is initialised by its module's ``reset_parameters()`` (torch's layers), others are
    refused with an error naming the module. Either way the parameters equal single-device
    initialisation from the same seed.
    """

    def __init__(
        self,
        *,
        num_replicas: int | None = None,
        units: UnitSpec = None,
        reshard_after_forward: bool | None = None,
        mixed_precision: Any = None,
        offload: Any = None,
        gradient_reduction: ReduceOp | str = ReduceOp.SUM,
        shard_size: int | None = None,
        timeout: float = 120.0,
        devices: str | None = None,
        init: str = "auto",
    ) -> None:
        check_init(init, "ShardedStrategy")
        if num_replicas is not None and num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        started = start("ShardedStrategy", devices, timeout=timeout, replicas=num_replicas)
        device = started.device
        if offload is True:
            from torch.distributed.fsdp import CPUOffloadPolicy

            offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        options = ShardingOptions(
            units=units,
            reshard_after_forward=reshard_after_forward,
            mixed_precision=mixed_precision,
            offload=offload or None,
            gradient_op=ReduceOp.of(gradient_reduction).value,
            shard_size=shard_size,
        )
        self.cluster_spec = started.spec
        self.device = device
        job = started.mesh(sharded_layout(started.comm.world_size, shard_size))
        super().__init__(ShardedExtended(job, options, name="ShardedStrategy", init=init))
