"""FSDP applied in one place: ``fully_shard`` on a model's units, then its root, with ShardedStrategy's options."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratagem.distribute.engines.shard_plan import UnitPlan, UnitSpec, plan_units


@dataclass(frozen=True)
class ShardingOptions:
    """How a model is sharded (ShardedStrategy's arguments)."""

    units: UnitSpec = None
    # None: torch's default (each unit freed after its forward, the root kept for the backward
    # that follows at once); True: the root too; False: every unit kept until its backward
    reshard_after_forward: bool | None = None
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
    kw: dict[str, Any] = {"mesh": mesh}
    if options.reshard_after_forward is not None:  # else torch's own choice, as fully_shard by hand
        kw["reshard_after_forward"] = options.reshard_after_forward
    if options.mixed_precision is not None:
        kw["mp_policy"] = options.mixed_precision
    if options.offload is not None:
        kw["offload_policy"] = options.offload
    # each unit's output made a non-view just before FSDP's own forward hook (fully_shard
    # appends it): after the hooks already there, such as a tensor-parallel layer's, whose
    # conversion of its output to a local tensor makes the view
    for path in plan.units:
        unit = root.get_submodule(path)
        unit.register_forward_hook(_not_a_view)
        fully_shard(unit, **kw)
    root.register_forward_hook(_not_a_view)
    fully_shard(root, **kw)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            if options.gradient_op == "sum":
                m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return plan


def _not_a_view(module: nn.Module, args: Any, output: Any) -> Any:
    """A unit's output that is a view of another tensor (``nn.Linear`` on a 3-D input returns one)
    is replaced by a copy, before FSDP hooks its backward on it: an in-place op on a view (the
    next layer's ``x += y``) would drop that hook, and the unit's gradient with it (FSDP warns
    "returned a view tensor"). Registered just before FSDP's own forward hook."""
    if not torch.is_grad_enabled():
        return None
    if isinstance(output, torch.Tensor):
        return output.clone() if output._base is not None and output.requires_grad else None
    if isinstance(output, (tuple, list)) and any(
        isinstance(t, torch.Tensor) and t._base is not None and t.requires_grad for t in output
    ):
        copied = [
            t.clone() if isinstance(t, torch.Tensor) and t._base is not None and t.requires_grad else t for t in output
        ]
        return type(output)(copied) if isinstance(output, list) else tuple(copied)
    return None


class ShardedRoots:
    """The roots an engine sharded with ``apply_fsdp`` (held weakly), and the one thing done to
    all of them at once: leaving their gradients unreduced for gradient accumulation."""

    def __init__(self) -> None:
        self._roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def add(self, root: nn.Module) -> None:
        self._roots.add(root)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate each unit's unsharded gradient locally, with no
        reduce-scatter (FSDP2's ``set_requires_gradient_sync(False)``, what a user writes by hand
        for accumulation); the first backward after it reduce-scatters the accumulated sum once."""
        roots = list(self._roots)
        for root in roots:
            root.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            for root in roots:
                root.set_requires_gradient_sync(True)  # type: ignore[operator]
