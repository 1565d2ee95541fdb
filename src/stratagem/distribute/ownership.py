"""Which strategy created a module or an optimizer (Keras's ``model.distribute_strategy``).

A strategy's scope claims every parameter and buffer created inside it; a module or optimizer
belongs to the strategy that created its parameters. ``fit``, ``evaluate``, ``predict`` and
checkpoints use that strategy when none is given, and refuse a different one. Claims are weak:
they do not keep tensors or strategies alive.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from stratagem.distribute.strategy import Strategy

_claims: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Strategy]]] = {}


class StrategyMismatchError(ValueError):
    """A model, optimizer or checkpoint is used under a strategy other than the one that made it."""


class OutsideScopeError(StrategyMismatchError):
    """A module or optimizer used under a strategy was not created in its scope."""


def claim(tensor: torch.Tensor, strategy: Strategy) -> None:
    """Record that ``strategy``'s scope created ``tensor``."""
    key = id(tensor)

    def forget(_ref: object, key: int = key) -> None:
        _claims.pop(key, None)

    _claims[key] = (weakref.ref(tensor, forget), weakref.ref(strategy))


def _owner_of_tensor(t: torch.Tensor) -> Strategy | None:
    entry = _claims.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    return entry[1]()


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.optim.Optimizer):
        return [p for g in obj.param_groups for p in g["params"]]
    if isinstance(obj, nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    module = getattr(obj, "module", None)  # a pipeline's Pipe: its stage's module
    if isinstance(module, nn.Module):
        return _tensors(module)
    return []


def strategy_of(obj: Any) -> Strategy | None:
    """The strategy whose scope created ``obj``'s parameters (None: created outside any scope).

    Raises StrategyMismatchError when its parameters come from the scopes of different strategies.
    """
    found: Strategy | None = None
    for t in _tensors(obj):
        owner = _owner_of_tensor(t)
        if owner is None:
            continue
        if found is None:
            found = owner
        elif owner is not found:
            raise StrategyMismatchError(
                f"{type(obj).__name__} holds parameters created in the scopes of two strategies "
                f"({found!r} and {owner!r}); create the whole model in one strategy's scope"
            )
    return found


def resolve(objects: dict[str, Any], given: Strategy | None, current: Strategy | None, what: str) -> Strategy | None:
    """The strategy ``what`` runs under: the one that created ``objects`` (by name), which must
    agree with ``given`` (an explicit ``strategy=``) or, failing that, the open scope's
    ``current``. Returns None when nothing decides (use the default strategy)."""
    owners = {name: strategy_of(o) for name, o in objects.items() if o is not None}
    made = {n: s for n, s in owners.items() if s is not None}
    distinct = {id(s): s for s in made.values()}
    if len(distinct) > 1:
        listing = ", ".join(f"{n} in {s!r}" for n, s in made.items())
        raise StrategyMismatchError(
            f"{what}: the objects were created under different strategies ({listing}); create "
            "them in one strategy's scope"
        )
    owner = next(iter(distinct.values()), None)
    chosen = given if given is not None else current
    if owner is not None and chosen is not None and chosen is not owner:
        names = ", ".join(made)
        how = "strategy=" if given is not None else "the open scope of"
        raise StrategyMismatchError(
            f"{what}: {names} was created in the scope of {owner!r} but is used under "
            f"{how} {chosen!r}; pass strategy= the strategy that created it (or leave it out: "
            "the model's own strategy is used)"
        )
    if owner is None and chosen is not None and chosen.extended.requires_scope:
        names = ", ".join(n for n, o in objects.items() if o is not None)
        raise OutsideScopeError(
            f"{what}: {names} was not created in the scope of {chosen!r}; create the model and "
            "its optimizer inside `with strategy.scope():` so its variables are mirrored"
        )
    return owner if owner is not None else chosen
