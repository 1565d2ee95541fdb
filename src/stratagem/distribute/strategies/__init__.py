"""strategies: the final strategy classes (default, one device, mirrored, multi-worker, pipeline)."""

from stratagem.distribute.strategies.default import DefaultStrategy
from stratagem.distribute.strategies.mirrored import MirroredStrategy
from stratagem.distribute.strategies.multi_worker import MultiWorkerMirroredStrategy
from stratagem.distribute.strategies.one_device import OneDeviceStrategy
from stratagem.distribute.strategies.pipeline import PipelineStrategy
from stratagem.distribute.strategies.sharded import ShardedStrategy
from stratagem.distribute.strategies.tensor_parallel import ModelParallelStrategy

__all__ = [
    "DefaultStrategy",
    "ModelParallelStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "PipelineStrategy",
    "ShardedStrategy",
]
