"""stratagem.train: fit/evaluate/predict, metrics, callbacks, progress, history and checkpoints."""

# --- fit, evaluate, predict (issue 6) ---
from stratagem.train import callbacks, metrics
from stratagem.train.callback import Callback, FitState
from stratagem.train.callbacks import latest_checkpoint, load_weights

# --- checkpoints (issue 5) ---
from stratagem.train.checkpoint import (  # noqa: E402
    Checkpoint,
    CheckpointCorruptError,
    CheckpointManager,
    RNGState,
)

# --- fit, evaluate, predict (issue 6), continued ---
from stratagem.train.fit import evaluate, fit, predict  # noqa: E402
from stratagem.train.history import History  # noqa: E402

__all__ = [
    "Callback",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointManager",
    "FitState",
    "History",
    "RNGState",
    "callbacks",
    "evaluate",
    "fit",
    "latest_checkpoint",
    "load_weights",
    "metrics",
    "predict",
]
