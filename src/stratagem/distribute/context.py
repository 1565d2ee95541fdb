"""The one ambient state: which strategy's scope is open and which replica is running.

Two context variables and the scopes that set and always restore them. Nothing here knows what
a strategy is (``current.py`` answers ``get_strategy()`` with the default strategy when no scope
is open), so every other module of ``distribute`` may import this one.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_strategy: contextvars.ContextVar[Any] = contextvars.ContextVar("stratagem_strategy", default=None)
_replica: contextvars.ContextVar[Any] = contextvars.ContextVar("stratagem_replica", default=None)


def current_strategy() -> Any:
    """The strategy whose scope (or ``run``) is open, or None."""
    return _strategy.get()


def current_replica() -> Any:
    """The replica context of the ``strategy.run`` executing, or None."""
    return _replica.get()


@contextlib.contextmanager
def strategy_scope(strategy: Any) -> Iterator[None]:
    """Make ``strategy`` the current one; entering another strategy's scope inside is an error."""
    current = _strategy.get()
    if current is not None and current is not strategy:
        raise RuntimeError(
            f"cannot enter the scope of {type(strategy).__name__} inside the scope of "
            f"{type(current).__name__}; use one strategy at a time"
        )
    token = _strategy.set(strategy)
    try:
        yield
    finally:
        _strategy.reset(token)


@contextlib.contextmanager
def replica_scope(ctx: Any) -> Iterator[None]:
    """Inside ``strategy.run``: the replica context ``ctx`` (and its strategy) are current."""
    t1 = _strategy.set(ctx.strategy)
    t2 = _replica.set(ctx)
    try:
        yield
    finally:
        _replica.reset(t2)
        _strategy.reset(t1)


@contextlib.contextmanager
def cross_replica(strategy: Any) -> Iterator[None]:
    """A cross-replica context of ``strategy`` (inside its scope, outside any replica)."""
    t1 = _strategy.set(strategy)
    t2 = _replica.set(None)
    try:
        yield
    finally:
        _replica.reset(t2)
        _strategy.reset(t1)


#: (examples in the global batch, pieces in it) while strategy.run calls a step once per piece
#: (the deterministic mode): what the step's losses are counted against
_pieces: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("stratagem_pieces", default=None)


@contextlib.contextmanager
def pieces_of_global_batch(examples: int, pieces: int) -> Iterator[None]:
    """Inside: the step runs on one of ``pieces`` pieces of a global batch of ``examples``."""
    token = _pieces.set((examples, pieces))
    try:
        yield
    finally:
        _pieces.reset(token)


def global_batch_pieces() -> tuple[int, int] | None:
    """(examples in the global batch, its pieces) inside a piece of a step; None elsewhere."""
    return _pieces.get()
