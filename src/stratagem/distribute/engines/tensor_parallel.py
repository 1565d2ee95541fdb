"""TensorParallelExtended: layers split over a mesh's "model" axis on DTensor, the batch over its "data" axis.

The scope builds on the host as on one device (or, with ``init="meta"``, on the meta device:
``build``); when it closes, the layers a LayoutMap splits
along the model axis are parallelized with torch's ``parallelize_module`` (column-wise: output
features split, row-wise: input features split and the partial outputs all-reduced, Megatron's
pair), the rest replicated, every shard equal to what one device builds. On a
2-D mesh the tensor-parallel model is also sharded over the data axis, block by block, by the
one FSDP path (``fsdp.apply_fsdp``: FSDP x TP), so each data-parallel replica holds 1/D of it and gradients are reduce-scattered
across replicas. Replicas are the data axis: processes along the model axis read the same batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from stratagem.comm import Communicator, LocalCommunicator
from stratagem.comm.failure import collectives_explained
from stratagem.comm.mesh import JobMesh
from stratagem.distribute.engines.build import ShardedBuild, retarget_optimizer
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.engines.fsdp import ShardedRoots, ShardingOptions, apply_fsdp
from stratagem.distribute.engines.layout import (
    DeviceMesh,
    LayoutMap,
    is_conv1d,
    tensor_parallel_plan,
)
from stratagem.distribute.engines.meta_init import allocated_keeping_buffers
from stratagem.distribute.engines.over_replicas import OverReplicas
from stratagem.distribute.strategy import StateLayout, Strategy

_RULES: list[bool] = []


def register_attention_rules() -> None:
    """DTensor sharding rules (torch's ``register_sharding``, its extension point) for the CPU
    flash-attention kernel behind ``F.scaled_dot_product_attention``, which torch ships without
    one: replicated, or split by batch or by head, in and out, forward and backward. Registered
    once per process; it only adds what DTensor refused before."""
    if _RULES:
        return
    _RULES.append(True)
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is None or bwd is None:
        return
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    def masks(kwargs: dict[str, Any], d: int | None) -> list[Any]:
        """Placements of the tensor keyword arguments (an attention mask, [batch, heads, q, k] or
        broadcast along batch or heads): split along ``d`` with q, k and v unless broadcast there
        (size 1), else whole."""
        out: list[Any] = []
        for value in kwargs.values():
            shape = getattr(value, "shape", None)
            if shape is None:
                continue  # a number (scale): not a tensor
            out.append(Shard(d) if d is not None and len(shape) == 4 and shape[d] > 1 else Replicate())
        return out

    @register_sharding(fwd.default)  # type: ignore[untyped-decorator]
    def _forward(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> list[Any]:
        extra: list[Any] = [None] * len(args)  # dropout_p, is_causal when given: not tensors
        rules: list[Any] = [
            ([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), *extra, *masks(kwargs, None)])
        ]
        rules += [([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), *extra, *masks(kwargs, d)]) for d in (0, 1)]
        return rules

    @register_sharding(bwd.default)  # type: ignore[untyped-decorator]
    def _backward(g: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, *args: Any, **kwargs: Any) -> list[Any]:
        extra: list[Any] = [None] * len(args)
        rules: list[Any] = [([Replicate()] * 3, [*[Replicate()] * 6, *extra, *masks(kwargs, None)])]
        rules += [([Shard(d)] * 3, [*[Shard(d)] * 6, *extra, *masks(kwargs, d)]) for d in (0, 1)]
        return rules


def conv1d_style(kind: str) -> Any:
    """torch's column- / row-parallel style for a Hugging Face ``Conv1D``, whose weight is (in, out)
    (torch's styles know Linear, whose weight is (out, in)): the same inputs and outputs, the
    weight split along the other dimension (the bias with the outputs, or whole)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    weight_dim, bias = (1, Shard(0)) if kind == "colwise" else (0, Replicate())

    def partition(name: str, module: nn.Module, mesh: Any) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Shard(weight_dim) if pname == "weight" else bias
            dist = distribute_tensor(param, mesh, [placement])
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    base = ColwiseParallel if kind == "colwise" else RowwiseParallel

    class Conv1DStyle(base):  # type: ignore[valid-type, misc]
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            if kind == "rowwise":  # (torch's RowwiseParallel sets it per module type in _apply)
                self.desired_input_layouts = (Shard(-1),)
            return distribute_module(  # type: ignore[no-any-return]
                module, device_mesh, partition,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            )  # fmt: skip

    return Conv1DStyle(use_local_output=False) if kind == "colwise" else Conv1DStyle()


def split_layers(root: nn.Module, plan: Mapping[str, str], mesh: Any) -> None:
    """Split ``root``'s layers as ``plan`` says (``{module path: "colwise" | "rowwise"}``, from
    ``tensor_parallel_plan``; the path "" is ``root`` itself) over the 1-D torch mesh ``mesh``:
    torch's ``parallelize_module``. A column-parallel layer's output stays a DTensor (split along
    features): whatever the model does with it next (a split into q, k, v, a view into heads)
    sees the whole logical tensor, gathered where an op needs it; a row-parallel layer takes it
    as it is."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    modules = dict(root.named_modules())
    styles: dict[str, ParallelStyle] = {}
    for path, kind in plan.items():
        if is_conv1d(modules[path]):
            styles[path] = conv1d_style(kind)
        else:
            styles[path] = ColwiseParallel(use_local_output=False) if kind == "colwise" else RowwiseParallel()
    if not styles:
        return
    register_attention_rules()
    parallelize_module(root, mesh, styles[""] if "" in styles else styles)


class TensorParallelExtended(OverReplicas):
    """A model split by a LayoutMap over a DeviceMesh's model axis (and sharded over its data axis)."""

    def __init__(
        self,
        job: JobMesh,
        mesh: DeviceMesh,
        layout_map: LayoutMap,
        *,
        model_axis: str = "model",
        batch_axis: str | None = "data",
        name: str,
        init: str = "auto",
        sharding: ShardingOptions | None = None,
    ) -> None:
        mesh.check_world(job.world.world_size, name)
        if model_axis not in mesh.axis_names:
            raise ValueError(f"{name}: the mesh has axes {mesh.axis_names}, none named {model_axis!r}")
        if batch_axis is not None and batch_axis not in mesh.axis_names:
            batch_axis = None
        self.job = job
        self.world_comm = world = job.world
        self._device = device = job.device
        self.mesh = mesh
        self.layout_map = layout_map
        self.model_axis = model_axis
        self.batch_axis = batch_axis
        self.name = name
        self.sharding = sharding or ShardingOptions()
        # the batch axis on the job's mesh: itself, or (HSDP x TP) cut into replicate x shard
        self.data_axes = job.layout.data_axes(batch_axis) if batch_axis is not None else ()
        self.data_comm: Communicator = job.comm(*self.data_axes) if self.data_axes else LocalCommunicator(device)
        self._dp = DataParallelExtended(self.data_comm, device, mirror=False, name=name)
        self.build = ShardedBuild(world, device, name, self._shard, self.owner, init)
        self.plans: list[dict[str, str]] = []
        self.plans_fsdp: list[Any] = []  # the FSDP unit plan of each model sharded over the batch axis
        self.roots = ShardedRoots()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return retarget_optimizer(optimizer)

    def bind(self, strategy: Strategy) -> None:
        super().bind(strategy)
        self._dp.bind(strategy)

    @property
    def torch_mesh(self) -> Any:
        """torch's DeviceMesh of the job (the mesh's shape and axis names; with HSDP x TP the
        batch axis is two, ``data_replicate`` x ``data_shard``)."""
        return self.job.torch

    # --- facts ------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self.data_comm.world_size

    @property
    def replica_id(self) -> int:
        return self.data_comm.rank

    @property
    def device(self) -> torch.device | None:
        return self._device

    @property
    def should_checkpoint(self) -> bool:
        return True

    @property
    def world(self) -> Communicator:
        return self.world_comm

    @property
    def requires_scope(self) -> bool:
        return True

    @property
    def state_layout(self) -> StateLayout:
        return StateLayout.SHARDED

    def barrier(self) -> None:
        self.world_comm.barrier()

    # --- scope ------------------------------------------------------------------------------
    def scope(self) -> contextlib.AbstractContextManager[None]:
        return self.build.scope()

    def _shard(self, root: nn.Module, materialized: bool) -> None:
        plan = tensor_parallel_plan(root, self.layout_map, self.model_axis)
        self.plans.append(plan)
        # built on meta: real (empty) storage once sharded, initialised by the replay after
        with allocated_keeping_buffers(root, self._device) if not materialized else contextlib.nullcontext():
            if plan:
                split_layers(root, plan, self.torch_mesh[self.model_axis])
            if materialized:
                root.to(self._device)  # what stays whole (the split parts are on it already)
            if self.data_comm.world_size > 1:
                # each unit's tensor-parallel parts sharded over the data axis, as ShardedStrategy
                # shards (torchtitan's FSDP x TP; HSDP x TP over replicate x shard), with its
                # options; summed across replicas
                self.plans_fsdp.append(apply_fsdp(root, self.torch_mesh[self.data_axes], self.sharding))
                self.roots.add(root)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.roots.no_sync()

    # --- run (reductions and input: OverReplicas) ----------------------------------------------
    def call_for_replica(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        self.build.check_call(fn, args, kwargs)
        from torch.distributed.tensor.experimental import implicit_replication

        # the model's own plain tensors (an attention mask it builds) meet the DTensors of the
        # split layers' outputs as replicated DTensors (torch's public context for mixed ops)
        with implicit_replication(), collectives_explained(self._dp.comm, "a tensor-parallel collective"):
            return self._dp.call_for_replica(fn, args, kwargs)
