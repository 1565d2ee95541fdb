"""stratagem: tf.distribute strategies, tf.data pipelines and GPipe pipelines for PyTorch."""

# the `stratagem` command only: a Ctrl-C lost inside `import torch` (below) still ends it
from stratagem.core import stop_guard as _stop_guard

_stop_guard.guard_command()

from stratagem import callbacks, cluster_resolver, coordinator, data, losses, metrics, partitioners
from stratagem._version import __version__
from stratagem.cluster.spawn import LaunchError, LaunchTimeoutError, launch
from stratagem.comm import (
    CollectiveError,
    CollectiveTimeoutError,
    ReplicaMismatchError,
    WorkerFailedError,
)
from stratagem.comm.failure import FailureOptions
from stratagem.distribute import (
    DeviceMesh,
    InputContext,
    LayoutMap,
    MirroredStrategy,
    ModelParallelStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    OutsideScopeError,
    ParameterServerStrategy,
    PipelineStrategy,
    ReduceOp,
    ReplicaContext,
    ShardedStrategy,
    ShardingOptions,
    Strategy,
    StrategyMismatchError,
    TPUStrategy,
    compute_average_loss,
    function,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
    initialize_tpu_system,
    mixed_precision,
    scale_regularization_loss,
    strategy_of,
)
from stratagem.distribute.bootstrap import (
    ClusterConfigurationError,
    CommunicationOptions,
    connect_to_cluster,
    initialize_system,
)
from stratagem.distribute.engines.ps_client import ParameterServerError
from stratagem.distribute.input_options import InputOptions
from stratagem.distribute.mixed_precision import RunOptions
from stratagem.distribute.process import is_chief, print
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
    "DeviceMesh",
    "FailureOptions",
    "History",
    "InputContext",
    "InputOptions",
    "LaunchError",
    "LaunchTimeoutError",
    "LayoutMap",
    "MirroredStrategy",
    "ModelParallelStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "OutsideScopeError",
    "ParameterServerError",
    "PipelineStrategy",
    "RNGState",
    "ReduceOp",
    "ReplicaContext",
    "ReplicaMismatchError",
    "RunOptions",
    "ShardedStrategy",
    "ShardingOptions",
    "Strategy",
    "TPUStrategy",
    "StrategyMismatchError",
    "WorkerFailedError",
    "__version__",
    "callbacks",
    "cluster_resolver",
    "compute_average_loss",
    "scale_regularization_loss",
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
    "initialize_tpu_system",
    "is_chief",
    "launch",
    "losses",
    "metrics",
    "mixed_precision",
    "partitioners",
    "coordinator",
    "predict",
    "print",
    "strategy_of",
]

# --- Keras's habits on the model (issue 30): compile, fit, evaluate, predict, save ---
from stratagem import optimizers, utils  # noqa: E402
from stratagem.train.keras_model import Model, Sequential, keras_model, load_model  # noqa: E402

__all__ += ["Model", "Sequential", "keras_model", "load_model", "optimizers", "utils"]
