"""What ``stratagem.function`` does not trace: marked here, handed to dynamo on first use.

Decorating with ``torch.compiler.disable`` at import time would import dynamo (about 2 s per
process); instead the functions are recorded and wrapped the first time ``stratagem.function``
compiles a step. Standard library only (torch is imported when the marks are applied), so every
layer may mark its own.

Three kinds of marks. ``eager_only`` names methods or functions that run eagerly, with everything
they call (``torch.compiler.disable``): collectives, a dataset's iterators, a metric's state.
``eager_frames`` names functions whose own frame runs eagerly while the functions they call are
compiled as usual (``disable(recursive=False)``): ``strategy.run``'s machinery, between a compiled
caller and the step it runs. ``eager_hooks`` names factories of autograd hooks: the closures they
return were registered before dynamo was loaded, so they cannot be wrapped; instead dynamo is
told to skip their code (each closure must do nothing but call an ``eager_only`` method). The
autograd engine calls such hooks during a ``backward()`` inside a compiled step, and dynamo would
otherwise trace each closure and specialise it on its captured values: one recompilation per
parameter.

A module-level function is wrapped in its module: only calls that look it up there at call time
(from the same module) run eagerly; a name imported elsewhere keeps the unwrapped function.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator
from typing import Any

_marked: list[tuple[Any, str]] = []
_frames: list[tuple[Any, str]] = []
_hooks: list[tuple[Any, str]] = []
_applied: list[bool] = []


def eager_only(owner: Any, names: Iterable[str]) -> None:
    """Record attributes of ``owner`` (a class or module) that must not be traced."""
    items = [(owner, n) for n in names]
    _marked.extend(items)
    if _applied:
        _disable(items)


def eager_frames(owner: Any, names: Iterable[str]) -> None:
    """Record attributes of ``owner`` whose own frames must not be traced (their callees are)."""
    items = [(owner, n) for n in names]
    _frames.extend(items)
    if _applied:
        _disable(items, recursive=False)


def eager_hooks(owner: Any, factories: Iterable[str]) -> None:
    """Record methods of ``owner`` whose nested functions (hooks) dynamo must skip."""
    items = [(owner, n) for n in factories]
    _hooks.extend(items)
    if _applied:
        _skip(items)


def _disable(items: Iterable[tuple[Any, str]], *, recursive: bool = True) -> None:
    import torch

    for owner, name in items:
        setattr(owner, name, torch.compiler.disable(getattr(owner, name), recursive=recursive))


def _nested_code(code: types.CodeType) -> Iterator[types.CodeType]:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield const
            yield from _nested_code(const)


def _skip(items: Iterable[tuple[Any, str]]) -> None:
    from torch._dynamo.eval_frame import skip_code

    for owner, name in items:
        fn = getattr(owner, name)
        for code in _nested_code(getattr(fn, "__code__", None) or fn.__func__.__code__):
            skip_code(code)


def disable_for_compiler() -> None:
    """Wrap every recorded function in ``torch.compiler.disable`` (once per process)."""
    if not _applied:
        _applied.append(True)
        _disable(_marked)
        _disable(_frames, recursive=False)
        _skip(_hooks)
