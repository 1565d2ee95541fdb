"""distribute: the Strategy API (strategy, context, reduce ops, function, loss), the engines
strategies are made of (``engines/``), and the strategies themselves (``strategies/``)."""

from stratagem.core.mesh import DeviceMesh
from stratagem.distribute.current import (
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from stratagem.distribute.engines.fsdp import ShardingOptions
from stratagem.distribute.engines.input import InputContext
from stratagem.distribute.engines.layout import LayoutMap
from stratagem.distribute.function import function
from stratagem.distribute.loss import compute_average_loss, scale_regularization_loss
from stratagem.distribute.ownership import OutsideScopeError, StrategyMismatchError, strategy_of
from stratagem.distribute.reduce_op import ReduceOp
from stratagem.distribute.strategies import (
    MirroredStrategy,
    ModelParallelStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    ParameterServerStrategy,
    PipelineOptions,
    PipelineStrategy,
    ShardedStrategy,
    TPUStrategy,
    initialize_tpu_system,
    strategy_on_mesh,
)
from stratagem.distribute.strategy import (
    PerReplica,
    ReplicaContext,
    Strategy,
    StrategyExtended,
    ValueContext,
)

__all__ = [
    "DeviceMesh",
    "InputContext",
    "LayoutMap",
    "MirroredStrategy",
    "ModelParallelStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "OutsideScopeError",
    "ParameterServerStrategy",
    "PipelineOptions",
    "PipelineStrategy",
    "ReduceOp",
    "PerReplica",
    "ReplicaContext",
    "ShardedStrategy",
    "ShardingOptions",
    "Strategy",
    "StrategyExtended",
    "TPUStrategy",
    "initialize_tpu_system",
    "StrategyMismatchError",
    "ValueContext",
    "compute_average_loss",
    "scale_regularization_loss",
    "strategy_on_mesh",
    "function",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "strategy_of",
]
