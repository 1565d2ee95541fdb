"""stratagem: tf.distribute strategies, tf.data pipelines and GPipe pipelines for PyTorch."""

from stratagem import callbacks, cluster_resolver, data, metrics
from stratagem._version import __version__
from stratagem.comm import (
    CollectiveError,
    CollectiveTimeoutError,
    ReplicaMismatchError,
    WorkerFailedError,
)
from stratagem.comm.failure import FailureOptions
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
from stratagem.distribute.bootstrap import (
    ClusterConfigurationError,
    CommunicationOptions,
    connect_to_cluster,
    initialize_system,
)
from stratagem.distribute.multi_worker import MultiWorkerMirroredStrategy
from stratagem.distribute.pipeline_strategy import PipelineStrategy
from stratagem.train import (
    Callback,
    Checkpoint,
    CheckpointCorruptError,
    CheckpointManager,
    History,
    RNGState,
    evaluate,
    fit,
    predict,
)

__all__ = [
    "Callback",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointManager",
    "ClusterConfigurationError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CommunicationOptions",
    "FailureOptions",
    "History",
    "InputContext",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "OutsideScopeError",
    "PipelineStrategy",
    "RNGState",
    "ReduceOp",
    "ReplicaContext",
    "ReplicaMismatchError",
    "Strategy",
    "WorkerFailedError",
    "__version__",
    "callbacks",
    "cluster_resolver",
    "compute_average_loss",
    "connect_to_cluster",
    "data",
    "evaluate",
    "fit",
    "function",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "initialize_system",
    "metrics",
    "predict",
]
