"""stratagem: tf.distribute strategies, tf.data pipelines and GPipe pipelines for PyTorch."""

from stratagem._version import __version__

from stratagem.comm import CollectiveError, ReplicaMismatchError, WorkerFailedError
from stratagem.distribute import (
    InputContext,
    MirroredStrategy,
    OneDeviceStrategy,
    OutsideScopeError,
    ReduceOp,
    ReplicaContext,
    Strategy,
    compute_average_loss,
    function,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)


__all__ = [
    "CollectiveError",
    "InputContext",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "OutsideScopeError",
    "ReduceOp",
    "ReplicaContext",
    "ReplicaMismatchError",
    "Strategy",
    "WorkerFailedError",
    "compute_average_loss",
    "function",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]
