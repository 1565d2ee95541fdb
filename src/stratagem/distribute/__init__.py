"""distribute: the Strategy API, its contexts and values, and the data-parallel strategies."""

from stratagem.distribute.context import (
    ReplicaContext,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from stratagem.distribute.function import function
from stratagem.distribute.input import InputContext
from stratagem.distribute.loss import compute_average_loss
from stratagem.distribute.mirror import OutsideScopeError
from stratagem.distribute.mirrored import MirroredStrategy
from stratagem.distribute.one_device import OneDeviceStrategy
from stratagem.distribute.reduce_op import ReduceOp
from stratagem.distribute.strategy import Strategy, StrategyExtended

__all__ = [
    "InputContext",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "OutsideScopeError",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "compute_average_loss",
    "function",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]
