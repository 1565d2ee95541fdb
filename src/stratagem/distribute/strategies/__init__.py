"""strategies: the final strategy classes (default, one device, mirrored, multi-worker, pipeline, sharded, tensor parallel, TPU, parameter server)."""

from stratagem.distribute.strategies.default import DefaultStrategy
from stratagem.distribute.strategies.mirrored import MirroredStrategy
from stratagem.distribute.strategies.multi_worker import MultiWorkerMirroredStrategy
from stratagem.distribute.strategies.on_mesh import PipelineOptions, strategy_on_mesh
from stratagem.distribute.strategies.one_device import OneDeviceStrategy
from stratagem.distribute.strategies.parameter_server import ParameterServerStrategy
from stratagem.distribute.strategies.pipeline import PipelineStrategy
from stratagem.distribute.strategies.sharded import ShardedStrategy
from stratagem.distribute.strategies.tensor_parallel import ModelParallelStrategy
from stratagem.distribute.strategies.tpu import TPUStrategy, initialize_tpu_system

__all__ = [
    "DefaultStrategy",
    "ModelParallelStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PipelineOptions",
    "PipelineStrategy",
    "ShardedStrategy",
    "TPUStrategy",
    "initialize_tpu_system",
    "strategy_on_mesh",
]
