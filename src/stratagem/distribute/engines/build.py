"""ShardedBuild: what a sharding strategy's scope builds, sharded and initialised in place.

Two ways to build, chosen by ``init``:

- ``"materialize"`` (and ``"auto"``, the default): the scope builds the model on the host exactly
  as one device would (every line of its ``__init__``, its own initialisation included: nanoGPT's
  ``_init_weights``, Hugging Face's ``post_init()``); when the scope closes each outermost module is
  handed to the strategy's ``shard_root`` (``fully_shard``, ``parallelize_module``), which keeps
  this process's part of every parameter, and the full tensors are freed. The peak while
  building is one full copy of the model per process.
- ``"meta"``: the scope builds on the meta device (``meta_init``); when it closes, the modules are
  sharded with empty local parts and every shard is initialised by replaying the modules'
  ``reset_parameters()`` one module at a time, so no process ever holds the whole model. Only
  for models whose every parameter is initialised by its module's ``reset_parameters()`` (torch's
  layers); a model that initialises parameters any other way is refused with an error naming the
  module, never silently initialised otherwise than on one device.

``"auto"`` builds on the host: whether a model's constructor will rewrite its weights after its
layers' ``reset_parameters()`` (as nanoGPT and Hugging Face models do) is only known once it has
run, and then a meta build has lost those values, so the exact way is the default and the
meta build is opted into. Either way the replicas check they built the same model and the
parameters are claimed for the strategy. An optimizer created in the scope holds the parameters
built there; it is pointed at the shards that replaced them (``retarget_optimizer``) before its
first step.
"""

from __future__ import annotations

import contextlib
import logging
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
_log = logging.getLogger("stratagem")

#: the ways a sharding scope builds a model (see the module docstring)
INIT_MODES = ("auto", "materialize", "meta")


def check_init(init: str, where: str) -> str:
    if init not in INIT_MODES:
        raise ValueError(
            f"{where}: init must be one of {', '.join(repr(m) for m in INIT_MODES)}; got {init!r}"
        )
    return init


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


def _tied_names(root: nn.Module) -> list[list[str]]:
    """The names of each parameter ``root`` registers under more than one name."""
    names: dict[int, list[str]] = {}
    for n, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [v for v in names.values() if len(v) > 1]


def _free_replaced(built: Sequence[tuple[nn.Module, str, torch.Tensor]], roots: list[nn.Module]) -> None:
    """Release the storage of the full parameters built on the host that sharding replaced
    (an optimizer made in the scope, or a name the user kept, may still hold them: their
    storage goes now, not at that object's end), unless a shard still uses it (a replicated
    DTensor may wrap the tensor it was given)."""
    from torch.distributed.tensor import DTensor

    kept: set[int] = set()
    for root in roots:
        for t in (*root.parameters(), *root.buffers()):
            local = t.to_local() if isinstance(t, DTensor) else t
            kept.add(local.untyped_storage().data_ptr())
    done: set[int] = set()
    for m, n, p in built:
        if m._parameters.get(n) is p or id(p) in done or p.is_meta:
            continue
        done.add(id(p))
        storage = p.untyped_storage()
        if storage.data_ptr() not in kept and storage.size() > 0:
            storage.resize_(0)


class ShardedBuild:
    """Build (on the host, or on meta), shard with ``shard_root(root, materialized)``,
    initialise each shard (meta), claim for the strategy."""

    def __init__(
        self,
        comm: Communicator,
        device: torch.device,
        name: str,
        shard_root: Callable[[nn.Module, bool], None],
        owner: Callable[[], Strategy],
        init: str = "auto",
    ) -> None:
        self.init = check_init(init, name)
        self.on_meta = init == "meta"
        self.comm = comm
        self.device = device
        self.name = name
        self.shard_root = shard_root
        self.owner = owner
        self._capture = MetaCapture(on_meta=self.on_meta)
        self._logged = False
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
        if self.on_meta:
            check_resettable(modules, self.name)
        self._check_same(roots)
        self._log_choice(roots)
        built = [(m, n, p) for m in modules for n, p in m._parameters.items() if p is not None]
        ties = [_tied_names(root) for root in roots]
        for root, tied in zip(roots, ties):
            self.shard_root(root, not self.on_meta)
            self._check_ties(root, tied)
        for m, n, p in built:
            if m._parameters.get(n) is not p:
                _remember_replaced(p, m, n)
        if self.on_meta:
            materialize(modules, rng, self.device)
        else:
            _free_replaced(built, roots)
        _install_hook()
        owner = self.owner()
        for _, _, p in built:
            ownership.claim(p, owner)  # as built (what an optimizer made in the scope holds)
        for root in roots:
            for t in (*root.parameters(), *root.buffers()):
                ownership.claim(t, owner)
            for sub in root.modules():
                self._sharded.add(sub)

    def _check_ties(self, root: nn.Module, tied: list[list[str]]) -> None:
        """A parameter registered under several names (a tied embedding and head) must still be
        one parameter once sharded: fully_shard keeps it one; a layout that splits one name's
        layer and not the other's would train two copies apart."""
        for names in tied:
            found = {id(root.get_parameter(n)) for n in names}
            if len(found) > 1:
                kinds = ", ".join(f"{n} ({type(root.get_parameter(n)).__name__})" for n in names)
                raise ValueError(
                    f"{self.name}: {' and '.join(names)} are one tied parameter, but sharding made "
                    f"them {len(found)} ({kinds}): the layout splits the layer of one name and not "
                    "the other's. Leave tied weights replicated (no LayoutMap key matching them), "
                    "or untie them in the model"
                )

    def _log_choice(self, roots: list[nn.Module]) -> None:
        if self._logged or not roots or self.comm.rank != 0:
            return
        self._logged = True
        what = ", ".join(type(r).__name__ for r in roots)
        if self.on_meta:
            _log.info("%s: built %s on the meta device (init='meta'); each shard initialised by "
                      "replaying reset_parameters()", self.name, what)
        else:
            _log.info("%s: built %s on the host as on one device (init=%r), then sharded it and "
                      "freed the full copy; init='meta' builds without a full copy for models "
                      "initialised by reset_parameters() only", self.name, what, self.init)

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
