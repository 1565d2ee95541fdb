"""ReduceOp: how per-replica values are combined (tf.distribute.ReduceOp)."""

from __future__ import annotations

import enum


class ReduceOp(str, enum.Enum):
    """``SUM`` adds the replicas' values; ``MEAN`` divides the sum by the number of values."""

    SUM = "sum"
    MEAN = "mean"

    @classmethod
    def of(cls, op: ReduceOp | str) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls(str(op).lower())
        except ValueError:
            raise ValueError(f"unknown reduce op {op!r}; use stratagem.ReduceOp.SUM or MEAN") from None
