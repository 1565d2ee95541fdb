"""Mirrored variables without a wrapper: what ``scope()`` captures and how it is kept in sync.

While a strategy's scope is open, torch's global registration hooks see every parameter and
buffer a module registers: each is placed on the replica's device and remembered. When the
scope closes, replicas check that they created the same parameters (names, shapes, dtypes),
rank 0's values are broadcast to all, and one GradientReducer is (re)built over every mirrored
parameter, so gradients are reduced during backward. Modules used in ``strategy.run`` whose
parameters were not created in a scope are refused with a clear error.

Lazy modules (``nn.LazyLinear``, ``nn.LazyBatchNorm1d``, ...) register uninitialized parameters
and buffers: they are claimed (placed, owned) when registered and synced when their module's
first forward pass materializes them, wherever it runs (a dry run in the scope, the first
``strategy.run``, a compiled step): a forward pre-hook, after torch's own, broadcasts rank 0's
values and rebuilds the reducer before the forward pass uses them. Every replica runs that
first forward pass at the same point of the program, as it runs every other collective.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

from stratagem.comm import Communicator
from stratagem.comm.reducer import GradientReducer
from stratagem.distribute import ownership
from stratagem.distribute.ownership import OutsideScopeError
from stratagem.distribute.strategy import Strategy

# a lazy module's uninitialized tensor: (tensor, name, is a parameter, its module)
_Lazy = tuple[weakref.ref[torch.Tensor], str, bool, weakref.ref[nn.Module]]


class _BufferSlot(NamedTuple):
    ref: weakref.ref[torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


def _alive_or_scratch(slot: _BufferSlot) -> torch.Tensor:
    t = slot.ref()
    return t if t is not None else torch.empty(slot.shape, dtype=slot.dtype, device=slot.device)


class _IdSet:
    """A set of objects by identity that does not keep them alive (tensors compare by value)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[Any]] = {}

    def add(self, t: Any) -> None:
        key = id(t)
        refs = self._refs

        def forget(_ref: object) -> None:
            refs.pop(key, None)

        refs[key] = weakref.ref(t, forget)

    def __contains__(self, t: object) -> bool:
        r = self._refs.get(id(t))
        return r is not None and r() is t


# The registry whose ``strategy.run`` is executing. The hooks that consult it are installed
# once per process and never change, so compiled steps are not recompiled because of them.
_checking: contextvars.ContextVar[MirrorRegistry | None] = contextvars.ContextVar(
    "stratagem_checking", default=None
)
_hooks_installed: list[bool] = []


def _check_module_hook(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():  # first: dynamo cannot trace the context variable
        return
    reg = _checking.get()
    if reg is not None and module not in reg._checked_modules:
        reg.check_module(module)


def _check_optimizer_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling():
        return
    reg = _checking.get()
    if reg is not None and opt not in reg._checked_optimizers:
        reg.check_optimizer(opt)


def _install_hooks() -> None:
    if _hooks_installed:
        return
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optim_mod

    module_mod.register_module_forward_pre_hook(_check_module_hook)
    optim_mod.register_optimizer_step_pre_hook(_check_optimizer_hook)
    _hooks_installed.append(True)


class MirrorRegistry:
    """The parameters and buffers created in one strategy's scope."""

    def __init__(
        self,
        comm: Communicator,
        device: torch.device | None,
        *,
        gradient_op: str = "sum",
        first_bucket_bytes: int | None = None,
        bucket_bytes: int | None = None,
        strategy_name: str = "strategy",
        owner: Callable[[], Strategy] | None = None,
    ) -> None:
        self.comm = comm
        self.owner = owner
        self.device = device
        self.gradient_op = gradient_op
        self.bucket_kw = {"first_bucket_bytes": first_bucket_bytes, "bucket_bytes": bucket_bytes}
        self.strategy_name = strategy_name
        self._mirrored = _IdSet()
        self._params: list[tuple[weakref.ref[torch.Tensor], str]] = []
        #: BatchNorm layers made in the scope (the deterministic mode refuses them in training)
        self._batch_norms: list[weakref.ref[nn.Module]] = []
        self._buffers: list[tuple[weakref.ref[torch.Tensor], str]] = []
        self._step_buffers: list[_BufferSlot] = []  # the buffers agreed at the last sync
        self._trainable: list[tuple[weakref.ref[torch.Tensor], bool]] = []  # when the reducer was built
        self._new: list[tuple[torch.Tensor, str]] = []
        self._checked_modules = _IdSet()  # by identity: a copy of a checked module is checked anew
        self._checked_optimizers = _IdSet()
        # lazy modules' uninitialized tensors: (tensor, name, is a parameter, module)
        self._lazy: list[_Lazy] = []
        self._lazy_hooks: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        self.reducer: GradientReducer | None = None
        self.armed = False  # inside this strategy's run: backward may reduce gradients
        self._depth = 0

    # --- capture --------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Capture parameters and buffers registered inside; sync them when the scope closes."""
        self._depth += 1
        if self._depth > 1:
            try:
                yield
            finally:
                self._depth -= 1
            return
        from torch.nn.modules import module as module_mod

        h1 = module_mod.register_module_parameter_registration_hook(self._on_parameter)
        h2 = module_mod.register_module_buffer_registration_hook(self._on_buffer)
        ok = False
        try:
            yield
            ok = True
        finally:
            h1.remove()
            h2.remove()
            self._depth -= 1
            if ok:
                self.sync()

    def _place(self, t: torch.Tensor) -> torch.Tensor | None:
        if self.device is None or t.device == self.device or t.device.type == "meta":
            return None
        return t.to(self.device)

    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> Any:
        if param is None:
            return None
        if isinstance(param, nn.parameter.UninitializedParameter):
            return self._lazy_tensor(module, name, param, is_param=True)
        moved = self._place(param)
        if moved is not None:
            param = nn.Parameter(moved, requires_grad=param.requires_grad)
        self._remember(param, f"{type(module).__name__}.{name}", is_param=True)
        return param if moved is not None else None

    def _on_buffer(self, module: nn.Module, name: str, buffer: torch.Tensor | None) -> Any:
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and name == "running_mean":
            self._batch_norms.append(weakref.ref(module))
        if buffer is None:
            return None
        if isinstance(buffer, nn.parameter.UninitializedBuffer):
            return self._lazy_tensor(module, name, buffer, is_param=False)
        moved = self._place(buffer)
        if moved is not None:
            buffer = moved
        self._remember(buffer, f"{type(module).__name__}.{name}", is_param=False)
        return buffer if moved is not None else None

    def _remember(self, t: torch.Tensor, name: str, *, is_param: bool) -> None:
        if t in self._mirrored:
            return
        self._mirrored.add(t)
        if self.owner is not None:
            ownership.claim(t, self.owner())
        (self._params if is_param else self._buffers).append((weakref.ref(t), name))
        self._new.append((t, name))

    # --- lazy modules -----------------------------------------------------------------------
    def _lazy_tensor(self, module: nn.Module, name: str, t: Any, *, is_param: bool) -> Any:
        """An uninitialized parameter or buffer of a lazy module: placed on the replica's device
        (it materializes where it is), claimed now, synced when its module materializes it."""
        placed = None
        if self.device is not None and t.data.device != self.device:
            cls = type(t)
            placed = cls(requires_grad=t.requires_grad, device=self.device, dtype=t.data.dtype)
            t = placed
        if t not in self._mirrored:
            self._mirrored.add(t)
            if self.owner is not None:
                ownership.claim(t, self.owner())
            self._lazy.append((weakref.ref(t), f"{type(module).__name__}.{name}", is_param, weakref.ref(module)))
        if module not in self._lazy_hooks:
            # after torch's own pre-hook (registered in LazyModuleMixin.__init__, before the
            # module registers its parameters), so the tensors are materialized when it runs;
            # in a compiled step the hook is a graph break: the sync runs eagerly
            hook = torch.compiler.disable(self._materialized_hook)
            self._lazy_hooks[module] = module.register_forward_pre_hook(hook)
        return placed

    def _materialized_hook(self, module: nn.Module, args: Any) -> None:
        """A lazy module's forward pass is about to use the tensors it just materialized: make
        them rank 0's everywhere and reduce their gradients (collective; every replica)."""
        if any(m is module and (t := r()) is not None and _uninitialized(t) for r, _, _, mr in self._lazy if (m := mr()) is not None):
            return  # not yet (a module whose own hook comes after this one)
        keep: list[_Lazy] = []
        ready: list[_Lazy] = []
        for e in self._lazy:
            t = e[0]()
            if t is not None:
                (keep if _uninitialized(t) else ready).append(e)
        self._lazy = keep
        for r, name, is_param, mref in ready:
            t = r()
            assert t is not None
            (self._params if is_param else self._buffers).append((r, name))
            self._new.append((t, name))
            m = mref()
            if m is not None and not any(e[3]() is m for e in keep) and m in self._lazy_hooks:
                self._lazy_hooks.pop(m).remove()
        if module in self._lazy_hooks:
            self._lazy_hooks.pop(module).remove()
        self.sync()

    # --- sync -------------------------------------------------------------------------------
    def sync(self, *, retrain: bool = False) -> None:
        """Make the tensors created since the last sync identical everywhere; rebuild the reducer.

        Every replica also says which of the tensors it tracks were garbage collected: Python
        frees a model caught in a reference cycle whenever its collector happens to run, which is
        not at the same moment on every replica. The tensors kept are those alive on all of them,
        so the reducer's buckets and the buffers broadcast before each step are the same list on
        every replica. Both hold them weakly; one that dies later on one replica only is stood in
        for there (zeros in the reducer, a scratch tensor in the broadcast) until the next sync."""
        new, self._new = self._new, []
        if not new and self.comm.world_size == 1:
            return
        retrain = retrain or self._trainable_changed()
        params = [(r(), n) for r, n in self._params]  # held while the replicas agree
        buffers = [r() for r, _ in self._buffers]
        new = [(t, n) for t, n in new if t.device.type != "meta"]
        gone_params = {i for i, (t, _) in enumerate(params) if t is None}
        gone_buffers = {i for i, t in enumerate(buffers) if t is None}
        if self.comm.world_size > 1:  # every replica takes part, also one that created nothing
            shapes = [(n, tuple(t.shape), str(t.dtype)) for t, n in new]
            mine = (shapes, len(params), len(buffers), sorted(gone_params), sorted(gone_buffers))
            everyone = self.comm.all_gather_object(mine)
            sigs = [e[0] for e in everyone]
            if any(s != sigs[0] for s in sigs):
                diff = next(r for r, s in enumerate(sigs) if s != sigs[0])
                raise ValueError(
                    f"replicas created different parameters in {self.strategy_name}.scope(): "
                    f"replica 0 created {_summary(sigs[0])}, replica {diff} created "
                    f"{_summary(sigs[diff])}; build the same model on every replica"
                )
            counts = [(e[1], e[2]) for e in everyone]
            if any(c != counts[0] for c in counts):
                raise ValueError(
                    f"replicas created different numbers of tensors in {self.strategy_name}.scope() "
                    f"since the strategy was made (parameters, buffers by replica: {counts}); "
                    "build the same models on every replica"
                )
            for e in everyone:
                gone_params.update(e[3])
                gone_buffers.update(e[4])
            if new:
                self.comm.broadcast_tensors_([t.data for t, _ in new], src=0)
        self._params = [e for i, e in enumerate(self._params) if i not in gone_params]
        self._buffers = [e for i, e in enumerate(self._buffers) if i not in gone_buffers]
        if self.comm.world_size > 1:  # broadcast before every step (one process has nothing to sync)
            self._step_buffers = [
                _BufferSlot(weakref.ref(t), t.shape, t.dtype, t.device)
                for i, t in enumerate(buffers)
                if i not in gone_buffers and t is not None and t.device.type != "meta"
            ]
        if new or gone_params or retrain:
            self._rebuild_reducer([(t, n) for i, (t, n) in enumerate(params) if i not in gone_params and t is not None])

    def batch_norms_training(self) -> list[nn.Module]:
        """The BatchNorm layers made in the scope that are in training mode now."""
        return [m for r in self._batch_norms if (m := r()) is not None and m.training]

    def trainable(self) -> list[torch.Tensor]:
        """The mirrored parameters alive that take gradients, in registration order."""
        return [t for r, _ in self._params if (t := r()) is not None and t.requires_grad and t.device.type != "meta"]

    def rejoined(self) -> None:
        """This process was let into a running job (``on_failure="continue"``), where it had been
        alone: the buffers broadcast before each step are the list the others keep (its ``sync``
        saw one process). Its values come from a live peer."""
        alive = [t for r, _ in self._buffers if (t := r()) is not None and t.device.type != "meta"]
        self._step_buffers = [_BufferSlot(weakref.ref(t), t.shape, t.dtype, t.device) for t in alive]

    def _trainable_changed(self) -> bool:
        """Whether a parameter's ``requires_grad`` changed since the reducer was built. Every
        replica runs the same program, so all see the change at the same ``run`` (a parameter
        already collected here keeps the flag it had, as it does where it is not yet)."""
        return any((t := r()) is not None and t.requires_grad != was for r, was in self._trainable)

    def _rebuild_reducer(self, params: list[tuple[torch.Tensor, str]]) -> None:
        old, self.reducer = self.reducer, None
        if old is not None:
            old.remove()
        params = [(p, n) for p, n in params if p.device.type != "meta"]
        if self.comm.world_size > 1:  # one process reduces nothing
            self._trainable = [(weakref.ref(p), p.requires_grad) for p, _ in params]
        params = [(p, n) for p, n in params if p.requires_grad]
        if self.comm.world_size > 1 and params:
            self.reducer = GradientReducer(
                self.comm,
                [p for p, _ in params],  # type: ignore[misc]
                [n for _, n in params],
                op=self.gradient_op,
                armed=self._is_armed,
                **{k: v for k, v in self.bucket_kw.items() if v is not None},
            )
            if old is not None:  # gradients accumulating across this scope are reduced once
                self.reducer.adopt(old)

    def _is_armed(self) -> bool:
        if not self.armed:
            raise RuntimeError(
                f"gradients of a model mirrored by {self.strategy_name} were computed outside "
                "strategy.run(...); compute the loss and call backward() inside the function "
                "you pass to strategy.run (or use stratagem.fit), so gradients are reduced "
                "across replicas exactly once"
            )
        return True

    def sync_buffers(self) -> None:
        """Broadcast rank 0's buffers (BatchNorm statistics) before a step, as DDP does."""
        if self.comm.world_size == 1:
            return
        # one agreed list on every replica: a buffer gone here (its model garbage collected,
        # maybe not yet elsewhere) is stood in for by a scratch tensor of its shape
        bufs = [_alive_or_scratch(slot) for slot in self._step_buffers]
        if bufs:
            self.comm.broadcast_tensors_(bufs, src=0)

    # --- checks -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Inside ``strategy.run``: modules called and optimizers stepped must be mirrored, and
        backward passes reduce the gradients (the reducer is armed)."""
        _install_hooks()
        if self._trainable_changed():  # e.g. a frozen layer unfrozen: its gradients must be reduced
            self.sync(retrain=True)
        token = _checking.set(self)
        was, self.armed = self.armed, True
        try:
            yield
        finally:
            self.armed = was
            _checking.reset(token)

    def is_mirrored(self, t: torch.Tensor) -> bool:
        return t in self._mirrored

    def check_module(self, module: nn.Module) -> None:
        if module in self._checked_modules:
            return
        for name, p in module.named_parameters():
            if p not in self._mirrored:
                raise OutsideScopeError(
                    f"{type(module).__name__} (parameter {name!r}, shape {_shape(p)}) was "
                    f"created outside {self.strategy_name}.scope(); create the model (and its "
                    f"optimizer) inside `with strategy.scope():` so its variables are mirrored"
                )
        self._checked_modules.add(module)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._checked_optimizers:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p not in self._mirrored:
                    raise OutsideScopeError(
                        f"{type(optimizer).__name__} steps a parameter of shape {_shape(p)} "
                        f"that was not created in {self.strategy_name}.scope(); create the model "
                        "inside `with strategy.scope():` so replicas stay identical"
                    )
        self._checked_optimizers.add(optimizer)


def _uninitialized(t: torch.Tensor) -> bool:
    return isinstance(t, UninitializedTensorMixin)


def _shape(t: torch.Tensor) -> str:
    return "uninitialized (lazy)" if _uninitialized(t) else str(tuple(t.shape))


def _summary(sig: list[tuple[str, tuple[int, ...], str]]) -> str:
    head = ", ".join(f"{n}{list(s)}" for n, s, _ in sig[:4])
    return f"{len(sig)} tensors ({head}{', ...' if len(sig) > 4 else ''})"
