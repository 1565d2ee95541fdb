"""stratagem: tf.distribute strategies, tf.data pipelines and GPipe pipelines for PyTorch.

Every public name is imported when first used (PEP 562's module ``__getattr__``): ``import
stratagem`` costs nothing until a strategy, a dataset or a callback is asked for, so the
``stratagem`` command's launcher and ``stratagem --help`` start without importing torch (seconds
on a small machine, paid again by every process the launcher then starts).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

# the `stratagem` command only: a Ctrl-C lost inside `import torch` (later) still ends it
from stratagem.core import stop_guard as _stop_guard

_stop_guard.guard_command()

from stratagem._version import __version__  # noqa: E402

if TYPE_CHECKING:
    from stratagem import (
        callbacks,
        cluster_resolver,
        coordinator,
        data,
        experimental,
        losses,
        metrics,
        optimizers,
        partitioners,
        saved_model,
        utils,
    )
    from stratagem.cluster.spawn import LaunchError, LaunchTimeoutError, launch
    from stratagem.comm import (
        CollectiveError,
        CollectiveMismatchError,
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
        PipelineOptions,
        PipelineStrategy,
        ReduceOp,
        ReplicaContext,
        ShardedStrategy,
        ShardingOptions,
        Strategy,
        StrategyMismatchError,
        TPUStrategy,
        compute_average_loss,
        get_replica_context,
        get_strategy,
        has_strategy,
        in_cross_replica_context,
        initialize_tpu_system,
        mixed_precision,
        scale_regularization_loss,
        strategy_of,
        strategy_on_mesh,
    )
    from stratagem.distribute.bootstrap import (
        ClusterConfigurationError,
        CommunicationImplementation,
        CommunicationOptions,
        connect_to_cluster,
        initialize_system,
    )
    from stratagem.distribute.engines.ps_client import ParameterServerError
    from stratagem.distribute.function import function
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
        predict,
    )
    from stratagem.train.fit import fit
    from stratagem.train.keras_model import (
        Model,
        Sequential,
        keras_model,
        load_model,
        register_keras_serializable,
    )

__all__ = [
    "Callback",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointManager",
    "ClusterConfigurationError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicationImplementation",
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
    "PipelineOptions",
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
    "experimental",
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
    "strategy_on_mesh",
]
__all__ += ["Model", "Sequential", "keras_model", "load_model", "optimizers", "register_keras_serializable", "utils"]
__all__ += ["saved_model"]

#: the modules of stratagem that are public names of the package
_SUBMODULES = (
    "callbacks",
    "cluster_resolver",
    "coordinator",
    "data",
    "experimental",
    "losses",
    "metrics",
    "partitioners",
    "optimizers",
    "saved_model",
    "utils",
)

#: where every other public name is defined
_DEFINED_IN: dict[str, str] = {
    "LaunchError": "stratagem.cluster.spawn",
    "LaunchTimeoutError": "stratagem.cluster.spawn",
    "launch": "stratagem.cluster.spawn",
    "CollectiveError": "stratagem.comm",
    "CollectiveMismatchError": "stratagem.comm",
    "CollectiveTimeoutError": "stratagem.comm",
    "ReplicaMismatchError": "stratagem.comm",
    "WorkerFailedError": "stratagem.comm",
    "FailureOptions": "stratagem.comm.failure",
    "DeviceMesh": "stratagem.distribute",
    "InputContext": "stratagem.distribute",
    "LayoutMap": "stratagem.distribute",
    "MirroredStrategy": "stratagem.distribute",
    "ModelParallelStrategy": "stratagem.distribute",
    "MultiWorkerMirroredStrategy": "stratagem.distribute",
    "OneDeviceStrategy": "stratagem.distribute",
    "OutsideScopeError": "stratagem.distribute",
    "ParameterServerStrategy": "stratagem.distribute",
    "PipelineOptions": "stratagem.distribute",
    "PipelineStrategy": "stratagem.distribute",
    "ReduceOp": "stratagem.distribute",
    "ReplicaContext": "stratagem.distribute",
    "ShardedStrategy": "stratagem.distribute",
    "ShardingOptions": "stratagem.distribute",
    "Strategy": "stratagem.distribute",
    "StrategyMismatchError": "stratagem.distribute",
    "TPUStrategy": "stratagem.distribute",
    "compute_average_loss": "stratagem.distribute",
    "function": "stratagem.distribute.function",
    "get_replica_context": "stratagem.distribute",
    "get_strategy": "stratagem.distribute",
    "has_strategy": "stratagem.distribute",
    "in_cross_replica_context": "stratagem.distribute",
    "initialize_tpu_system": "stratagem.distribute",
    "mixed_precision": "stratagem.distribute",
    "scale_regularization_loss": "stratagem.distribute",
    "strategy_of": "stratagem.distribute",
    "strategy_on_mesh": "stratagem.distribute",
    "ClusterConfigurationError": "stratagem.distribute.bootstrap",
    "CommunicationImplementation": "stratagem.distribute.bootstrap",
    "CommunicationOptions": "stratagem.distribute.bootstrap",
    "connect_to_cluster": "stratagem.distribute.bootstrap",
    "initialize_system": "stratagem.distribute.bootstrap",
    "ParameterServerError": "stratagem.distribute.engines.ps_client",
    "InputOptions": "stratagem.distribute.input_options",
    "RunOptions": "stratagem.distribute.mixed_precision",
    "is_chief": "stratagem.distribute.process",
    "print": "stratagem.distribute.process",
    "Callback": "stratagem.train",
    "Checkpoint": "stratagem.train",
    "CheckpointCorruptError": "stratagem.train",
    "CheckpointManager": "stratagem.train",
    "History": "stratagem.train",
    "RNGState": "stratagem.train",
    "evaluate": "stratagem.train",
    "fit": "stratagem.train.fit",
    "predict": "stratagem.train",
    "Model": "stratagem.train.keras_model",
    "Sequential": "stratagem.train.keras_model",
    "keras_model": "stratagem.train.keras_model",
    "load_model": "stratagem.train.keras_model",
    "register_keras_serializable": "stratagem.train.keras_model",
}


def __getattr__(name: str) -> Any:
    """Import a public name (or a subpackage, ``stratagem.distribute``) on first use."""
    if name in _DEFINED_IN:
        value = getattr(importlib.import_module(_DEFINED_IN[name]), name)
    elif name in _SUBMODULES or (
        not name.startswith("__") and importlib.util.find_spec(f"stratagem.{name}")
    ):
        value = importlib.import_module(f"stratagem.{name}")
    else:
        raise AttributeError(f"module 'stratagem' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _import_public() -> None:
    """Import everything the package names (a process about to fork workers does it once)."""
    for name in (*_SUBMODULES, *_DEFINED_IN):
        __getattr__(name)
