"""ShardedBuild: what a sharding strategy's scope builds, sharded and initialised in place.

The scope builds modules on the meta device (``meta_init``); when it closes, the replicas check
they built the same model, each outermost module is handed to the strategy's ``shard_root``
(``fully_shard``, ``parallelize_module``: parameters become DTensors with empty local parts),
every shard is initialised as one device would initialise it, and the parameters are claimed
for the strategy. An optimizer created in the scope holds the meta parameters built there; it is
pointed at the shards that replaced them (``retarget_optimizer``) before its first step.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.comm import Communicator
from stratagem.distribute import ownership
from stratagem.distribute.engines.meta_init import MetaCapture, check_resettable, materialize
from stratagem.distribute.ownership import OutsideScopeError
from stratagem.distribute.strategy import Strategy

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
            if p in optimizer.state:  # state loaded before the first step follows its parameter
                optimizer.state[new] = {
                    k: v.to(new.device) if isinstance(v, torch.Tensor) and k != "step" and v.device != new.device else v
                    for k, v in optimizer.state.pop(p).items()
                }
    _retargeted.add(optimizer)
    return optimizer


def _remember_replaced(p: torch.Tensor, module: nn.Module, name: str) -> None:
    key = id(p)

    def forget(_ref: object) -> None:
        _replaced.pop(key, None)

    _replaced[key] = (weakref.ref(p, forget), weakref.ref(module), name)


def remember_replaced(p: torch.Tensor, module: nn.Module, name: str) -> None:
    """``module.<name>`` replaced ``p``: an optimizer holding ``p`` is retargeted before its
    first step (the XLA engine's scope builds on the CPU, then moves parameters to the device)."""
    _remember_replaced(p, module, name)
    _install_hook()


def _retarget_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    retarget_optimizer(optimizer)


def _install_hook() -> None:
    if not _hook:
        from torch.optim import optimizer as optim_mod

        _hook.append(optim_mod.register_optimizer_step_pre_hook(_retarget_hook))


class ShardedBuild:
    """Capture on meta, shard with ``shard_root``, initialise each shard, claim for the strategy."""

    def __init__(
        self,
        comm: Communicator,
        device: torch.device,
        name: str,
        shard_root: Callable[[nn.Module], None],
        owner: Callable[[], Strategy],
    ) -> None:
        self.comm = comm
        self.device = device
        self.name = name
        self.shard_root = shard_root
        self.owner = owner
        self._capture = MetaCapture()
        self._depth = 0
        self._sharded: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
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
            else:  # the scope failed: what it captured is not built, nor replayed by the next one
                self._capture.take()
                self._capture.forget_structure()

    def _shard_new(self) -> None:
        modules, rng = self._capture.take()
        roots = self._capture.roots(modules)
        self._capture.forget_structure()
        if not modules:
            return
        check_resettable(modules, self.name)
        self._check_same(roots)
        built = [(m, n, p) for m in modules for n, p in m._parameters.items() if p is not None]
        for root in roots:
            self.shard_root(root)
        for m, n, p in built:
            if m._parameters.get(n) is not p:
                _remember_replaced(p, m, n)
        materialize(modules, rng, self.device)
        _install_hook()
        owner = self.owner()
        for _, _, p in built:
            ownership.claim(p, owner)  # as built (what an optimizer made in the scope holds)
        for root in roots:
            for t in (*root.parameters(), *root.buffers()):
                ownership.claim(t, owner)
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

    def check_module(self, module: nn.Module) -> None:
        if module in self._sharded:
            return
        for name, p in module.named_parameters():
            raise OutsideScopeError(
                f"{type(module).__name__} (parameter {name!r}, shape {tuple(p.shape)}) was created "
                f"outside {self.name}.scope(); create the model (and its optimizer) inside "
                "`with strategy.scope():` so its parameters are sharded"
            )

    def check_call(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Modules passed to ``strategy.run`` (or whose method it runs) must come from the scope."""
        for v in (getattr(fn, "__self__", None), *args, *kwargs.values()):
            if isinstance(v, nn.Module):
                self.check_module(v)
