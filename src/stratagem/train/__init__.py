"""stratagem.train: fit/evaluate/predict, metrics, callbacks, progress, history and checkpoints."""

# --- fit, evaluate, predict (issue 6) ---
from stratagem.train import callbacks, metrics
from stratagem.train.callback import Callback, FitState
from stratagem.train.fit import evaluate, fit, predict
from stratagem.train.history import History

# --- checkpoints (issue 5) ---
from stratagem.train.checkpoint import (  # noqa: E402
    Checkpoint,
    CheckpointCorruptError,
    CheckpointManager,
    RNGState,
)
