"""Build modules on the meta device, then give each process only its shard of every parameter.

While a sharding strategy's scope is open, every parameter a module registers is replaced by a
meta tensor of the same shape (nothing is allocated, no random numbers are drawn) and the module
is remembered in creation order. After the modules are sharded (their parameters are DTensors
whose local parts are empty), :func:`materialize` replays initialisation one module at a time,
in creation order, from the random state the first module saw: the module's parameters are
built whole on the device, its ``reset_parameters()`` runs (drawing exactly the random numbers
the same construction draws on one device), this process's part is copied into its shard and the
whole tensors are dropped. So values equal single-device initialisation from the same seed, and
no process holds more than one module's parameters whole at any time. A module made and dropped
in the scope (a replaced head, a scratch layer) is replayed too, for the random numbers it drew
on one device, and not kept; the capture holds every module until the scope closes, so what it
saw never depends on when Python's garbage collector ran on each replica.

The contract (the one torch documents for meta-device initialisation): a module that holds
parameters initialises them in ``reset_parameters()``, as torch's own layers do. A module with
parameters but no ``reset_parameters`` is refused with an error naming it.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


def _local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that ``like`` (a DTensor, or a plain tensor: all of it) holds here."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, like.device_mesh, like.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return full[index]


def _reset_fn(module: nn.Module) -> Callable[[], Any] | None:
    fn = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return fn if callable(fn) else None


class MetaCapture:
    """Parameters registered while :meth:`capture` is open are created on the meta device
    (``on_meta=False``: kept as built, only the modules and their structure are recorded)."""

    def __init__(self, on_meta: bool = True) -> None:
        self.on_meta = on_meta
        # held (not weakly) while the scope is open: a module dropped there (a replaced head, a
        # scratch layer) drew random numbers on one device, so the replay draws them too, and
        # what was captured never depends on when Python's garbage collector happened to run
        self._order: list[nn.Module] = []
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._children: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._parents: list[nn.Module] = []
        self._parent_set: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._rng: torch.Tensor | None = None

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        from torch.nn.modules import module as module_mod

        h1 = module_mod.register_module_parameter_registration_hook(self._on_parameter)
        h2 = module_mod.register_module_module_registration_hook(self._on_module)
        try:
            yield
        finally:
            h1.remove()
            h2.remove()

    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> Any:
        if param is None or isinstance(param, nn.parameter.UninitializedParameter):
            return None
        if module not in self._seen:
            if not self._order:
                self._rng = torch.get_rng_state()  # the state the first module's init starts from
            self._seen.add(module)
            self._order.append(module)
        if param.is_meta or not self.on_meta:
            return None
        return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)

    def _on_module(self, parent: nn.Module, name: str, child: nn.Module | None) -> Any:
        if child is not None:
            self._children.add(child)
            if parent not in self._parent_set:
                self._parent_set.add(parent)
                self._parents.append(parent)
        return None

    def roots(self, modules: list[nn.Module]) -> list[nn.Module]:
        """The outermost modules holding ``modules`` (those no module built in the scope
        registered as a child) that something besides this capture still holds, in the order
        they were first seen. A module dropped in the scope is no root (only replayed)."""
        candidates: dict[int, nn.Module] = {}
        for m in [*self._parents, *modules]:
            if m not in self._children:
                candidates.setdefault(id(m), m)
        wanted = {id(m) for m in modules}
        roots = []
        for key in list(candidates):
            m = candidates.pop(key)
            # the references counted here: getrefcount's argument, ``m``, and one per entry in
            # this capture's parents and the caller's ``modules``; any more is someone else's
            ours = 2 + sum(x is m for x in self._parents) + sum(x is m for x in modules)
            if sys.getrefcount(m) > ours and any(id(sub) in wanted for sub in m.modules()):
                roots.append(m)
        _check_disjoint(roots)
        return roots

    def take(self) -> tuple[list[nn.Module], torch.Tensor | None]:
        """The modules captured since the last call, in creation order, and the random state
        their initialisation starts from; forgets them."""
        mods, self._order = self._order, []
        rng, self._rng = self._rng, None
        self._seen = weakref.WeakSet()
        return mods, rng

    def forget_structure(self) -> None:
        self._parents = []
        self._parent_set = weakref.WeakSet()
        self._children = weakref.WeakSet()


def _check_disjoint(roots: list[nn.Module]) -> None:
    owner: dict[int, nn.Module] = {}
    for r in roots:
        for sub in r.modules():
            first = owner.setdefault(id(sub), r)
            if first is not r:
                raise ValueError(
                    f"{type(sub).__name__} built in the scope is part of two top-level modules, "
                    f"a {type(first).__name__} and a {type(r).__name__}; each is sharded whole, so "
                    "a module can belong to one of them only: build the second one outside the "
                    "scope, or drop it before the scope closes"
                )


def check_resettable(modules: list[nn.Module], where: str) -> None:
    """Every module holding parameters must initialise them in ``reset_parameters()``, and
    nothing else may have written them after it (a replay would lose that write)."""
    for m in modules:
        if any(p is not None for p in m._parameters.values()) and _reset_fn(m) is None:
            names = [n for n, p in m._parameters.items() if p is not None]
            raise TypeError(
                f"{type(m).__name__} holds parameters {names} but has no reset_parameters(); "
                f"{where} builds modules on the meta device and initialises each shard by calling "
                "reset_parameters() (as torch's layers do): move the initialisation of these "
                "parameters into a reset_parameters() method, or build with init='materialize' "
                "(the model is built on the host as on one device, then sharded)"
            )
    for m in modules:
        written = _written_outside_reset(m)
        if written:
            raise TypeError(
                f"{type(m).__name__}'s parameters {written} were written after its "
                f"reset_parameters() ran (an initialisation of the enclosing model, as nanoGPT's "
                f"_init_weights or Hugging Face's post_init() do); {where} with init='meta' "
                "initialises each shard by replaying reset_parameters() only, which would lose "
                "that write: build with init='materialize' (or 'auto')"
            )


def _written_outside_reset(m: nn.Module) -> list[str]:
    """The parameters of ``m`` (meta tensors) written in place more often than constructing
    ``m`` and calling its ``reset_parameters()`` once writes them (each in-place op bumps a
    tensor's version counter, on the meta device too)."""
    reset = _reset_fn(m)
    names = [n for n, p in m._parameters.items() if p is not None and p.is_meta]
    if reset is None or not names:
        return []
    kept = {n: m._parameters[n] for n in names}
    probe = {n: nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad) for n, p in kept.items() if p is not None}
    try:
        m._parameters.update(probe)
        reset()
    finally:
        m._parameters.update(kept)
    # the constructor calls reset_parameters() once (torch's layers do) or not at all
    return [n for n in names if kept[n]._version > probe[n]._version]  # type: ignore[union-attr]


def materialize(modules: list[nn.Module], rng: torch.Tensor | None, device: torch.device) -> None:
    """Initialise ``modules``' (already sharded, empty) parameters in creation order, one module
    whole at a time, keeping only this process's part; leaves the random state where the same
    initialisation on one device leaves it."""
    if rng is not None:
        torch.set_rng_state(rng)
    for m in modules:
        names = [n for n, p in m._parameters.items() if p is not None]
        if not names:
            continue
        reset = _reset_fn(m)
        assert reset is not None
        kept = {n: m._parameters[n] for n in names}
        whole = {
            n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            for n, p in kept.items()
            if p is not None
        }
        try:
            m._parameters.update(whole)
            reset()
        finally:
            m._parameters.update(kept)
        with torch.no_grad():
            for n, p in kept.items():
                assert p is not None
                local = p.to_local() if hasattr(p, "to_local") else p
                if not local.is_meta:  # still meta: a module dropped in the scope, replayed for its draws
                    local.copy_(_local_part(whole[n].detach(), p))
        del whole


@contextlib.contextmanager
def allocated_keeping_buffers(root: nn.Module, device: torch.device) -> Iterator[None]:
    """Shard ``root`` inside; on exit give it real storage on ``device`` (``to_empty``), with
    the buffers it was built with keeping their values (``to_empty`` would leave them empty)."""
    buffers = [(m, n, b) for m in root.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta]
    yield
    root.to_empty(device=device)
    for m, n, b in buffers:
        m._buffers[n] = b.to(device)
