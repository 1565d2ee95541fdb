"""Nested element structures: flatten, rebuild, describe and measure tuples/dicts of leaves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def flatten(element: Any) -> list[Any]:
    """Leaves of a nested tuple/dict element, in a stable order (dict keys sorted)."""
    if isinstance(element, tuple):
        return [leaf for item in element for leaf in flatten(item)]
    if isinstance(element, dict):
        return [leaf for key in sorted(element) for leaf in flatten(element[key])]
    return [element]


def pack_as(template: Any, leaves: list[Any]) -> Any:
    """Rebuild ``template``'s structure from ``leaves`` (the inverse of :func:`flatten`)."""
    it = iter(leaves)

    def build(node: Any) -> Any:
        if isinstance(node, tuple):
            items = [build(item) for item in node]
            return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
        if isinstance(node, dict):
            return {key: build(node[key]) for key in sorted(node)}
        return next(it)

    return build(template)


def map_structure(fn: Callable[..., Any], *elements: Any) -> Any:
    """Apply ``fn`` leaf-wise over elements of the same structure."""
    flats = [flatten(e) for e in elements]
    if any(len(f) != len(flats[0]) for f in flats):
        raise ValueError(
            f"elements have different structures: {[describe(e) for e in elements]}"
        )
    return pack_as(elements[0], [fn(*leaves) for leaves in zip(*flats)])


def shape_of(leaf: Any) -> tuple[int, ...]:
    """The shape of a leaf (a Python scalar or string has shape ())."""
    if isinstance(leaf, torch.Tensor | np.ndarray):
        return tuple(leaf.shape)
    return ()


def describe(element: Any) -> str:
    """A compact description of an element's structure and shapes, for error messages."""
    if isinstance(element, tuple):
        return "(" + ", ".join(describe(e) for e in element) + ")"
    if isinstance(element, dict):
        return "{" + ", ".join(f"{k!r}: {describe(element[k])}" for k in sorted(element)) + "}"
    if isinstance(element, torch.Tensor):
        return f"tensor{list(element.shape)}:{str(element.dtype).replace('torch.', '')}"
    if isinstance(element, np.ndarray):
        return f"ndarray{list(element.shape)}:{element.dtype}"
    return type(element).__name__


def nbytes(element: Any) -> int:
    """Approximate memory held by an element's leaves."""
    total = 0
    for leaf in flatten(element):
        if isinstance(leaf, torch.Tensor):
            total += leaf.element_size() * leaf.nelement()
        elif isinstance(leaf, np.ndarray):
            total += leaf.nbytes
        elif isinstance(leaf, str | bytes):
            total += len(leaf) + 49
        else:
            total += 32
    return total
