"""The deterministic mode (tf.config.experimental.enable_op_determinism's role, and more): the same
bits whatever the number of replicas (docs/design/DETERMINISM.md).

On: torch's deterministic algorithms, and ``fit`` under a data-parallel strategy cuts each
replica's batch into pieces of ``piece_size`` rows, computes each piece's gradient alone (its
random numbers drawn from a generator set by the update and the piece), and sums the pieces of
the global batch in one fixed tree (``core/canonical.py``). The state is this process's, as
tf's is: set it on every process before ``fit``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OpDeterminism:
    """The mode's settings: ``piece_size`` rows per piece (the same for every replica count)."""

    piece_size: int


_mode: OpDeterminism | None = None


def enable_op_determinism(piece_size: int = 32) -> None:
    """Make training give the same bits on one process and on any number of replicas.

    Switches torch's ``use_deterministic_algorithms(True)`` on (and cuBLAS's workspace setting on
    GPUs), and makes ``fit`` under MirroredStrategy, MultiWorkerMirroredStrategy or one process
    compute the gradient of each ``piece_size``-row piece of the global batch alone and sum the
    pieces in one fixed order. Every global batch must be a multiple of ``piece_size`` times the
    number of replicas (a clear error says so). Refused, with an error naming it: a model with
    BatchNorm in training (its statistics are over a batch, not a piece), gradient accumulation,
    and strategies that shard or pipeline the model. Costs time: pieces run one after another."""
    global _mode
    if isinstance(piece_size, bool) or not isinstance(piece_size, int) or piece_size < 1:
        raise ValueError(f"enable_op_determinism: piece_size must be a positive integer, got {piece_size!r}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    _mode = OpDeterminism(piece_size)


def disable_op_determinism() -> None:
    """Back to the default mode (torch's deterministic algorithms switched off)."""
    global _mode
    torch.use_deterministic_algorithms(False)
    _mode = None


def op_determinism() -> OpDeterminism | None:
    """The deterministic mode's settings, or None when it is off."""
    return _mode


#: steps ``strategy.run`` cut into pieces so far in this process (the same on every replica: the
#: pieces' random numbers follow it). ``sg.RNGState()`` saves and restores it, so a custom loop
#: resumed from a checkpoint, on any number of replicas, draws what the run that went on drew.
_piece_runs = [0]


def piece_runs() -> int:
    return _piece_runs[0]


def count_piece_run() -> None:
    _piece_runs[0] += 1


def restore_piece_runs(n: int) -> None:
    _piece_runs[0] = int(n)
