"""Nested values (tensors in tuples, lists, dicts): flatten to leaves, rebuild, describe."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# A tree definition: a leaf marker, or (kind, keys-or-length, children, extra).
TreeDef = Any
_LEAF = "*"


def flatten(value: Any) -> tuple[list[Any], TreeDef]:
    """The leaves of ``value`` in a fixed order and the definition that rebuilds it."""
    leaves: list[Any] = []

    def walk(v: Any) -> TreeDef:
        if isinstance(v, dict):
            keys = list(v.keys())
            return ("dict", tuple(keys), tuple(walk(v[k]) for k in keys), type(v))
        if isinstance(v, tuple) and hasattr(v, "_fields"):  # namedtuple
            return ("namedtuple", len(v), tuple(walk(x) for x in v), type(v))
        if isinstance(v, (tuple, list)):
            return ("tuple" if isinstance(v, tuple) else "list", len(v), tuple(walk(x) for x in v), None)
        leaves.append(v)
        return _LEAF

    return leaves, walk(value)


def unflatten(treedef: TreeDef, leaves: Sequence[Any]) -> Any:
    """Rebuild the value ``flatten`` took apart, with ``leaves`` in its places."""
    it = iter(leaves)

    def build(d: TreeDef) -> Any:
        if d == _LEAF:
            return next(it)
        kind, keys, children, typ = d
        vals = [build(c) for c in children]
        if kind == "dict":
            out = dict(zip(keys, vals))
            return out if typ is dict else typ(out)
        if kind == "namedtuple":
            return typ(*vals)
        return tuple(vals) if kind == "tuple" else list(vals)

    return build(treedef)


def map_structure(fn: Callable[[Any], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every leaf."""
    leaves, treedef = flatten(value)
    return unflatten(treedef, [fn(x) for x in leaves])


def signature(value: Any) -> str:
    """A compact description of structure, shapes and dtypes: ``(f32[4,3], {'a': i64[]})``."""

    def leaf(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            dt = str(x.dtype).replace("torch.", "")
            return f"{dt}[{','.join(str(s) for s in x.shape)}]"
        return type(x).__name__

    def walk(v: Any) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k!r}: {walk(x)}" for k, x in v.items()) + "}"
        if isinstance(v, (tuple, list)):
            o, c = ("(", ")") if isinstance(v, tuple) else ("[", "]")
            return o + ", ".join(walk(x) for x in v) + c
        return leaf(v)

    return walk(value)
