"""pipeline: GPipe/1F1B/zero-bubble/interleaved pipelines: schedules and partitions as data, micro-batching,
re-materialization, the stage runtime over point-to-point messages (imports only comm)."""

from stratagem.pipeline.config import PipelineConfig
from stratagem.pipeline.errors import PipelineConfigError, PipelineError, StageShapeError
from stratagem.pipeline.microbatch import loss_scales, split_sizes
from stratagem.pipeline.partition import Partition, block_partition
from stratagem.pipeline.pipe import Pipe
from stratagem.pipeline.rematerialize import MODES, rematerialize_stop
from stratagem.pipeline.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    make_schedule,
    one_f_one_b,
    simulate,
    zero_bubble,
)

__all__ = [
    "MODES",
    "SCHEDULES",
    "Action",
    "Partition",
    "Pipe",
    "PipelineConfig",
    "PipelineConfigError",
    "PipelineError",
    "Schedule",
    "StageShapeError",
    "block_partition",
    "rematerialize_stop",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "loss_scales",
    "make_schedule",
    "one_f_one_b",
    "simulate",
    "split_sizes",
    "zero_bubble",
]
