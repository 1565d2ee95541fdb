"""Checkpoints saved to disk: the object codec (``codec``), the file format (``files``) and the
objects users hold (``manager``: Checkpoint, CheckpointManager, RNGState)."""

from stratagem.train.checkpoint.codec import CheckpointCorruptError
from stratagem.train.checkpoint.files import (
    FORMAT,
    read_metadata,
    read_part,
    verify,
    write_checkpoint,
)
from stratagem.train.checkpoint.manager import Checkpoint, CheckpointManager, RNGState

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointManager",
    "RNGState",
    "read_metadata",
    "read_part",
    "verify",
    "write_checkpoint",
]
