"""Collectives run eagerly under torch.compile: marked here, handed to dynamo's disable on first use.

Decorating with ``torch.compiler.disable`` at import time would import dynamo (about 2 s per
process); instead the functions are recorded and wrapped the first time ``stratagem.function``
compiles a step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_marked: list[tuple[Any, str]] = []
_applied: list[bool] = []


def eager_only(owner: Any, names: Iterable[str]) -> None:
    """Record attributes of ``owner`` (a class or module) that must not be traced."""
    _marked.extend((owner, n) for n in names)
    if _applied:
        _disable([(owner, n) for n in names])


def _disable(items: Iterable[tuple[Any, str]]) -> None:
    import torch

    for owner, name in items:
        setattr(owner, name, torch.compiler.disable(getattr(owner, name)))


def disable_for_compiler() -> None:
    """Wrap every recorded function in ``torch.compiler.disable`` (once per process)."""
    if not _applied:
        _applied.append(True)
        _disable(_marked)
