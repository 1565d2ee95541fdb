"""The one ambient state: the current strategy (set by ``scope()``) and the replica context.

``get_strategy()`` is the strategy whose scope we are in, or the default strategy;
``get_replica_context()`` is the context of the replica running inside ``strategy.run``, the
default replica context outside any strategy, and None in a cross-replica context (inside a
scope, outside ``run``), as in tf.distribute.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from stratagem.distribute.reduce_op import ReduceOp

if TYPE_CHECKING:
    from stratagem.distribute.strategy import Strategy

_strategy: contextvars.ContextVar[Strategy | None] = contextvars.ContextVar("stratagem_strategy", default=None)
_replica: contextvars.ContextVar[ReplicaContext | None] = contextvars.ContextVar("stratagem_replica", default=None)
_default: list[Strategy] = []


class ReplicaContext:
    """What a replica sees inside ``strategy.run``: its id, the replica count, all_reduce."""

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int) -> None:
        self.strategy = strategy
        self.replica_id_in_sync_group = replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """``value`` reduced across replicas; every replica must pass the same structure/shapes."""
        return self.strategy.extended.all_reduce(ReduceOp.of(reduce_op), value)

    def __repr__(self) -> str:
        return f"ReplicaContext(replica {self.replica_id_in_sync_group} of {self.num_replicas_in_sync})"


def default_strategy() -> Strategy:
    if not _default:
        from stratagem.distribute.default import DefaultStrategy

        _default.append(DefaultStrategy())
    return _default[0]


def get_strategy() -> Strategy:
    """The strategy whose scope we are in, or the default (one-process, no-op) strategy."""
    s = _strategy.get()
    return s if s is not None else default_strategy()


def has_strategy() -> bool:
    """Whether we are inside some strategy's ``scope()``."""
    return _strategy.get() is not None


def get_replica_context() -> ReplicaContext | None:
    """The current replica context, or None in a cross-replica context."""
    ctx = _replica.get()
    if ctx is not None:
        return ctx
    if _strategy.get() is None:
        return ReplicaContext(default_strategy(), 0)
    return None


def in_cross_replica_context() -> bool:
    return _replica.get() is None and _strategy.get() is not None


@contextlib.contextmanager
def strategy_scope(strategy: Strategy) -> Iterator[None]:
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
def replica_scope(ctx: ReplicaContext) -> Iterator[None]:
    t1 = _strategy.set(ctx.strategy)
    t2 = _replica.set(ctx)
    try:
        yield
    finally:
        _replica.reset(t2)
        _strategy.reset(t1)
