"""tf.distribute's questions about the ambient state: ``get_strategy()`` and friends.

``get_strategy()`` is the strategy whose scope we are in, or the default strategy;
``get_replica_context()`` is the context of the replica running inside ``strategy.run``, the
default replica context outside any strategy, and None in a cross-replica context (inside a
scope, outside ``run``), as in tf.distribute.
"""

from __future__ import annotations

from stratagem.distribute import context
from stratagem.distribute.strategies.default import DefaultStrategy
from stratagem.distribute.strategy import ReplicaContext, Strategy

_default: list[Strategy] = []


def default_strategy() -> Strategy:
    """The process's default strategy (one replica, no-op), made on first use."""
    if not _default:
        _default.append(DefaultStrategy())
    return _default[0]


def get_strategy() -> Strategy:
    """The strategy whose scope we are in, or the default (one-process, no-op) strategy."""
    s = context.current_strategy()
    return s if s is not None else default_strategy()


def has_strategy() -> bool:
    """Whether we are inside some strategy's ``scope()``."""
    return context.current_strategy() is not None


def get_replica_context() -> ReplicaContext | None:
    """The current replica context, or None in a cross-replica context."""
    ctx = context.current_replica()
    if ctx is not None:
        return ctx  # type: ignore[no-any-return]
    if context.current_strategy() is None:
        return ReplicaContext(default_strategy(), 0)
    return None


def in_cross_replica_context() -> bool:
    """Inside a strategy's scope but not inside its ``run``."""
    return context.current_replica() is None and context.current_strategy() is not None
