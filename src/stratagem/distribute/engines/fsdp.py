"""FSDP applied in one place: ``fully_shard`` on a model's units, then its root, with ShardedStrategy's options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from stratagem.distribute.engines.shard_plan import UnitPlan, UnitSpec, plan_units


@dataclass(frozen=True)
class ShardingOptions:
    """How a model is sharded (ShardedStrategy's arguments)."""

    units: UnitSpec = None
    reshard_after_forward: bool = True
    mixed_precision: Any = None  # torch.distributed.fsdp.MixedPrecisionPolicy
    offload: Any = None  # torch.distributed.fsdp.CPUOffloadPolicy
    gradient_op: str = "sum"
    shard_size: int | None = None  # processes one copy is sharded over (None: all; else HSDP)


def apply_fsdp(root: nn.Module, mesh: Any, options: ShardingOptions) -> UnitPlan:
    """Shard ``root`` over torch's DeviceMesh ``mesh`` (1-D: FSDP; 2-D replicate x shard: HSDP):
    each unit of its plan (``shard_plan``: children first), then the root. Gradients are summed
    across the mesh (tf.distribute's contract: the loss is scaled by ``compute_average_loss``)
    unless ``options.gradient_op == "mean"``; the collectives are sum-type only (gloo has neither
    AVG nor PREMUL_SUM: FSDP divides before and after when it must). Returns the plan."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    plan = plan_units(root, options.units)
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": options.reshard_after_forward}
    if options.mixed_precision is not None:
        kw["mp_policy"] = options.mixed_precision
    if options.offload is not None:
        kw["offload_policy"] = options.offload
    for path in plan.units:
        fully_shard(root.get_submodule(path), **kw)
    fully_shard(root, **kw)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            if options.gradient_op == "sum":
                m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return plan
