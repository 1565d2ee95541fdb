"""Checkpoints saved to disk: the object codec (``codec``), the file format (``files``) and the
objects users hold (``manager``: Checkpoint, CheckpointManager; ``states``: RNGState)."""

from stratagem.train.checkpoint.codec import CheckpointCorruptError
from stratagem.train.checkpoint.files import (
    FORMAT,
    read_metadata,
    read_part,
    verify,
    write_checkpoint,
)
from stratagem.train.checkpoint.lock import CheckpointDirectoryLockedError
from stratagem.train.checkpoint.manager import (
    Checkpoint,
    CheckpointManager,
    export_safetensors,
    load_state_dict,
)
from stratagem.train.checkpoint.states import RNGState

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointDirectoryLockedError",
    "CheckpointManager",
    "RNGState",
    "export_safetensors",
    "load_state_dict",
    "read_metadata",
    "read_part",
    "verify",
    "write_checkpoint",
]
