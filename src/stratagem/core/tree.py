"""Nested values (tensors in tuples, lists, dicts, namedtuples): flatten, rebuild, map, describe.

One walker for the whole package, over ``torch.utils._pytree`` (the tree torch itself uses, so
``torch.compile`` and FSDP see the same leaves): dicts keep their insertion order, None is a
leaf, tensors and anything not a container are leaves. ``stratagem.data`` keeps tf.data's own
element structure (dict keys sorted, lists are values) in ``data/structure.py``, where tf.data's
semantics differ from this one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

TreeDef = pytree.TreeSpec


def flatten(value: Any) -> tuple[list[Any], TreeDef]:
    """The leaves of ``value`` in a fixed order and the definition that rebuilds it."""
    return pytree.tree_flatten(value)


def unflatten(treedef: TreeDef, leaves: Sequence[Any]) -> Any:
    """Rebuild the value ``flatten`` took apart, with ``leaves`` in its places."""
    return pytree.tree_unflatten(list(leaves), treedef)


def leaves(value: Any) -> list[Any]:
    """The leaves of ``value`` (``flatten(value)[0]``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    kind = type(value)
    if (kind is tuple or kind is list) and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    return pytree.tree_leaves(value)


def map_structure(
    fn: Callable[..., Any], value: Any, *others: Any, is_leaf: Callable[[Any], bool] | None = None
) -> Any:
    """``value`` with ``fn`` applied to every leaf (leaf-wise over ``others`` of the same
    structure); ``is_leaf`` marks containers to hand to ``fn`` whole."""
    if not others:
        if is_leaf is None:  # plain tuples, lists and dicts in Python, the rest by pytree
            try:
                return _plain_map(fn, value)
            except _NotPlain:
                pass
        return pytree.tree_map(fn, value, is_leaf=is_leaf)
    flat, spec = flatten(value)
    rest = [flatten(o) for o in others]
    for r, (_, s) in enumerate(rest):
        if s != spec:
            raise ValueError(
                f"values have different structures: {signature(value)} and {signature(others[r])}"
            )
    return unflatten(spec, [fn(*xs) for xs in zip(flat, *(f for f, _ in rest))])


class _NotPlain(Exception):
    """A container other than a tuple, list or dict: left to pytree."""


def _plain_map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``pytree.tree_map(fn, value)`` for values nesting only tuples, named tuples, lists and
    dicts (several times faster than the general walker; raises _NotPlain on any other
    container, before ``fn`` saw a leaf of it, though maybe after leaves beside it)."""
    kind = type(value)
    if kind is tuple or kind is list:
        return kind([_plain_map(fn, v) for v in value])
    if kind is dict:
        return {k: _plain_map(fn, v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return fn(value)
    if issubclass(kind, tuple) and hasattr(kind, "_fields") and kind not in pytree.SUPPORTED_NODES:
        return kind(*[_plain_map(fn, v) for v in value])  # a named tuple, as pytree rebuilds it
    if kind in pytree.SUPPORTED_NODES or issubclass(kind, tuple):
        raise _NotPlain
    return fn(value)


class _Shown(str):
    """A leaf's description, shown without quotes inside a container's repr."""

    def __repr__(self) -> str:
        return str(self)


def _describe_leaf(x: Any) -> _Shown:
    if isinstance(x, torch.Tensor):
        dt = str(x.dtype).replace("torch.", "")
        return _Shown(f"{dt}[{','.join(str(s) for s in x.shape)}]")
    return _Shown(type(x).__name__)


def signature(value: Any) -> str:
    """A compact description of structure, shapes and dtypes: ``(float32[4,3], {'a': int64[]})``."""
    flat, spec = flatten(value)
    return repr(unflatten(spec, [_describe_leaf(x) for x in flat]))
