"""The unit plan of a sharded model (pure): which submodules ``fully_shard`` wraps, by class or size.

A plan is a tuple of module paths in the order they are wrapped (children before parents; the
root, always wrapped last, is not listed), printed compactly (``units: 0 2 4 + root``) and
tested with ``==``. Each unit's parameters are all-gathered together before its forward and
freed after it, so the largest unit bounds the transient memory of a step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Union

from torch import nn

#: Which submodules form units: None (automatic), a class or classes, or a minimum parameter count.
UnitSpec = Union[None, type, tuple[type, ...], int]  # noqa: UP007 - a runtime alias


@dataclass(frozen=True)
class UnitPlan:
    """Module paths wrapped as units, children first; the root is always wrapped last."""

    units: tuple[str, ...]

    def __str__(self) -> str:
        return "units: " + " ".join(self.units) + (" + root" if self.units else "root")


def _direct_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module._parameters.values() if p is not None)


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _by_size(root: nn.Module, min_params: int) -> tuple[str, ...]:
    """Post-order: a submodule whose parameters not yet in a unit reach ``min_params`` is a unit."""
    left: dict[str, int] = {}
    units = []
    for path, module in _post_order(root):
        children = [f"{path}.{n}" if path else n for n, _ in module.named_children()]
        count = _direct_numel(module) + sum(left.pop(c, 0) for c in children)
        if path and count >= min_params:
            units.append(path)
            count = 0
        left[path] = count
    return tuple(units)


def _blocks(root: nn.Module) -> tuple[str, ...]:
    """The children holding parameters of the outermost ``ModuleList``/``Sequential`` containers."""
    found: list[str] = []

    def visit(module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            sub = f"{path}.{name}" if path else name
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                found.extend(f"{sub}.{n}" for n, c in child.named_children() if _numel(c))
            else:
                visit(child, sub)

    if isinstance(root, (nn.ModuleList, nn.Sequential)):
        found.extend(n for n, c in root.named_children() if _numel(c))
    else:
        visit(root, "")
    return tuple(found)


def plan_units(root: nn.Module, units: UnitSpec = None) -> UnitPlan:
    """Which submodules of ``root`` become units.

    ``units=None`` (automatic): the blocks of the outermost ``ModuleList``/``Sequential``
    containers (a transformer's layers, an MLP's linears), else units of at least 1/8 of the
    parameters; a class (or tuple of classes): every instance; an int: units of at least that
    many parameters, formed bottom-up.
    """
    if isinstance(units, bool):
        raise TypeError("units must be None, a module class, a tuple of classes or an int, not a bool")
    if isinstance(units, int):
        if units < 1:
            raise ValueError(f"units={units}: a minimum parameter count must be >= 1")
        return UnitPlan(_by_size(root, units))
    if isinstance(units, type) or (isinstance(units, tuple) and all(isinstance(u, type) for u in units)):
        classes = units if isinstance(units, tuple) else (units,)
        return UnitPlan(tuple(p for p, m in _post_order(root) if p and isinstance(m, classes)))
    if units is not None:
        raise TypeError(f"units must be None, a module class, a tuple of classes or an int; got {units!r}")
    blocks = _blocks(root)
    if blocks:
        return UnitPlan(blocks)
    return UnitPlan(_by_size(root, max(1, _numel(root) // 8)))
