"""ShardedExtended: one model sharded over every process with torch's ``fully_shard`` (ZeRO-3).

What the scope builds lands on the meta device (``meta_init``); when the scope closes, each
outermost module is split into units (``shard_plan``), ``fully_shard`` is applied to the units
and then the root over a 1-D DeviceMesh of the job, and every parameter's shard is initialised
exactly as one device would initialise it. Parameters are DTensors sharded on dim 0; FSDP
all-gathers a unit before its forward and backward and reduce-scatters its gradients (summed,
tf.distribute's contract with ``compute_average_loss``, unless ``gradient_op="mean"``), and the
optimizer, created over the sharded parameters, keeps its state with each shard.

Replicas are data-parallel: the batch is split across processes as under MirroredStrategy, so
reductions, gathers and distributed datasets are the data-parallel engine's, composed here.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.comm import Communicator
from stratagem.distribute import ownership
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.engines.meta_init import MetaCapture, check_resettable, materialize
from stratagem.distribute.engines.shard_plan import UnitPlan, UnitSpec, plan_units
from stratagem.distribute.ownership import OutsideScopeError
from stratagem.distribute.reduce_op import ReduceOp
from stratagem.distribute.strategy import Strategy, StrategyExtended

# meta parameter built in a sharding scope -> (module, name) of the DTensor that replaced it
# (by identity: tensors compare by value; entries leave with their tensor)
_replaced: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[nn.Module], str]] = {}
_retargeted: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_hook: list[Any] = []


def retarget_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Point an optimizer created in a sharding scope (before the model was sharded, when its
    parameters were still meta tensors) at the sharded parameters that replaced them."""
    if optimizer in _retargeted:
        return optimizer
    for group in optimizer.param_groups:
        params: list[torch.Tensor] = group["params"]
        for i, p in enumerate(params):
            where = _replaced.get(id(p))
            if where is None or where[0]() is not p:
                continue
            module = where[1]()
            if module is None:
                raise RuntimeError("the module whose parameters this optimizer steps no longer exists")
            new = module._parameters[where[2]]
            assert new is not None
            params[i] = new
            if p in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(p)
    _retargeted.add(optimizer)
    return optimizer


def _remember_replaced(p: torch.Tensor, module: nn.Module, name: str) -> None:
    key = id(p)

    def forget(_ref: object) -> None:
        _replaced.pop(key, None)

    _replaced[key] = (weakref.ref(p, forget), weakref.ref(module), name)


def _retarget_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    retarget_optimizer(optimizer)


def _install_hook() -> None:
    if not _hook:
        from torch.optim import optimizer as optim_mod

        _hook.append(optim_mod.register_optimizer_step_pre_hook(_retarget_hook))


@dataclass(frozen=True)
class ShardingOptions:
    """How modules are sharded: units, resharding, precision, offload, gradient reduction."""

    units: UnitSpec = None
    reshard_after_forward: bool = True
    mixed_precision: Any = None  # torch.distributed.fsdp.MixedPrecisionPolicy
    offload: Any = None  # torch.distributed.fsdp.CPUOffloadPolicy
    gradient_op: str = "sum"


def device_mesh_1d(comm: Communicator, device: torch.device) -> Any:
    """A 1-D DeviceMesh over the job's process group (a 1-process group when alone)."""
    from torch.distributed.device_mesh import DeviceMesh

    group = getattr(comm, "group", None)
    if group is None:
        if not dist.is_initialized():
            # one process: fully_shard still needs a process group (of one)
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
            )
        group = dist.group.WORLD
    return DeviceMesh.from_group(group, device.type)  # type: ignore[arg-type]


class ShardedExtended(StrategyExtended):
    """Every process holds 1/N of each parameter, its gradient and its optimizer state."""

    def __init__(self, comm: Communicator, device: torch.device, options: ShardingOptions, *, name: str) -> None:
        if options.gradient_op not in ("sum", "mean"):
            raise ValueError(f"gradient_op must be 'sum' or 'mean', got {options.gradient_op!r}")
        self.comm = comm
        self._device = device
        self.options = options
        self.name = name
        self._dp = DataParallelExtended(comm, device, mirror=False, name=name)
        self._mesh: Any = None
        self._capture = MetaCapture()
        self._depth = 0
        self._sharded: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.plans: list[UnitPlan] = []

    def bind(self, strategy: Strategy) -> None:
        super().bind(strategy)
        self._dp.bind(strategy)

    @property
    def mesh(self) -> Any:
        """The DeviceMesh the parameters are sharded over."""
        if self._mesh is None:
            self._mesh = device_mesh_1d(self.comm, self._device)
        return self._mesh

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
    def shards_state(self) -> bool:
        return True

    def barrier(self) -> None:
        self.comm.barrier()

    # --- scope: build on meta, then shard and initialise ------------------------------------
    @contextlib.contextmanager
    def _scope(self) -> Iterator[None]:
        self._depth += 1
        if self._depth > 1:
            try:
                yield
            finally:
                self._depth -= 1
            return
        ok = False
        try:
            with self._capture.capture():
                yield
            ok = True
        finally:
            self._depth -= 1
            if ok:
                self._shard_new()

    def scope(self) -> contextlib.AbstractContextManager[None]:
        return self._scope()

    def _shard_new(self) -> None:
        modules, rng = self._capture.take()
        roots = self._capture.roots(modules)
        self._capture.forget_structure()
        if not modules:
            return
        check_resettable(modules, self.name)
        self._check_same(roots)
        built = [p for m in modules for p in m._parameters.values() if p is not None]
        for root in roots:
            self._shard(root)
        materialize(modules, rng, self._device)
        _install_hook()
        owner = self.owner()
        for p in built:
            ownership.claim(p, owner)  # as built (what an optimizer made in the scope holds)
        for root in roots:
            for t in (*root.parameters(), *root.buffers()):
                ownership.claim(t, owner)
            self._sharded.add(root)
            for sub in root.modules():
                self._sharded.add(sub)

    def _check_same(self, roots: list[nn.Module]) -> None:
        if self.comm.world_size == 1:
            return
        sig = [(n, tuple(p.shape), str(p.dtype)) for r in roots for n, p in r.named_parameters()]
        sigs = self.comm.all_gather_object(sig)
        bad = next((r for r, s in enumerate(sigs) if s != sigs[0]), None)
        if bad is not None:
            raise ValueError(
                f"replicas built different models in {self.name}.scope(): replica 0 has "
                f"{len(sigs[0])} parameters, replica {bad} has {len(sigs[bad])}; build the same "
                "model on every replica"
            )

    def _shard(self, root: nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard

        opts = self.options
        plan = plan_units(root, opts.units)
        self.plans.append(plan)
        kw: dict[str, Any] = {"mesh": self.mesh, "reshard_after_forward": opts.reshard_after_forward}
        if opts.mixed_precision is not None:
            kw["mp_policy"] = opts.mixed_precision
        if opts.offload is not None:
            kw["offload_policy"] = opts.offload
        buffers = [(m, n, b) for m in root.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta]
        params = [(m, n, p) for m in root.modules() for n, p in m._parameters.items() if p is not None]
        for path in plan.units:
            fully_shard(root.get_submodule(path), **kw)
        fully_shard(root, **kw)
        root.to_empty(device=self._device)
        for m, n, b in buffers:  # to_empty emptied them: they keep the values they were built with
            m._buffers[n] = b.to(self._device)
        # an optimizer created in the scope holds the meta parameters built there: remember
        # which module parameter each stands for, so it is pointed at the shard (_retarget)
        for m, n, p in params:
            if m._parameters.get(n) is not p:
                _remember_replaced(p, m, n)
        # summed gradients (tf.distribute's contract) or FSDP's mean; sum-type collectives only
        # (gloo has neither AVG nor PREMUL_SUM), FSDP divides before and after when needed
        from torch.distributed.fsdp import FSDPModule

        for m in root.modules():
            if isinstance(m, FSDPModule):
                if opts.gradient_op == "sum":
                    m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)

    # --- run ----------------------------------------------------------------------------------
    def check_module(self, module: nn.Module) -> None:
        if module in self._sharded:
            return
        for name, p in module.named_parameters():
            raise OutsideScopeError(
                f"{type(module).__name__} (parameter {name!r}, shape {tuple(p.shape)}) was created "
                f"outside {self.name}.scope(); create the model (and its optimizer) inside "
                "`with strategy.scope():` so its parameters are sharded"
            )

    def call_for_replica(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        for v in (getattr(fn, "__self__", None), *args, *kwargs.values()):
            if isinstance(v, nn.Module):
                self.check_module(v)
        return self._dp.call_for_replica(fn, args, kwargs)

    # --- reductions and input: the data-parallel engine's ------------------------------------
    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        return self._dp.all_reduce(op, value)

    def reduce(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        return self._dp.reduce(op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        return self._dp.gather(value, axis)

    def distribute_dataset(self, dataset: Iterable[Any], options: Any) -> Iterable[Any]:
        return self._dp.distribute_dataset(dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any
    ) -> Iterable[Any]:
        return self._dp.distribute_datasets_from_function(dataset_fn, options)
