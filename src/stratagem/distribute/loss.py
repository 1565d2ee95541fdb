"""compute_average_loss: the per-replica loss whose summed gradients equal the global mean's."""

from __future__ import annotations

import sys
from typing import Any

import torch

from stratagem.core.eager import eager_only
from stratagem.core.sample_weights import weigh
from stratagem.distribute import context, current
from stratagem.distribute.strategy import Execution


def compute_average_loss(
    per_example_loss: torch.Tensor,
    global_batch_size: int | None = None,
    sample_weight: Any = None,
) -> torch.Tensor:
    """Sum of ``per_example_loss`` (times ``sample_weight``) divided by the global batch size.

    Gradients of mirrored parameters are *summed* across replicas, so dividing by the global
    batch size gives the gradient of the mean loss over the global batch. With
    ``global_batch_size=None`` the true global batch size is counted across replicas (one small
    all-reduce), so a partial last batch or a replica with an empty batch is exact. Dividing by
    the per-replica batch instead (a per-replica ``mean()``) would multiply the effective learning
    rate by the number of replicas.
    """
    loss = per_example_loss
    if loss.dim() == 0:
        raise ValueError(
            "compute_average_loss expects per-example losses with a batch dimension; got a scalar "
            "(use reduction='none' in the loss function)"
        )
    loss = weigh(loss, sample_weight)  # (N,) or (N, 1) weights, as Keras shapes them
    local = loss.shape[0]
    if global_batch_size is None and torch.compiler.is_compiling():
        # in a compiled step the count comes back as a tensor: an int read back from the
        # all-reduce would specialise the graph on it (a recompilation for a partial last batch)
        return (loss.sum().float() / _global_count_tensor(loss)).to(loss.dtype)
    if global_batch_size is None:
        global_batch_size = _global_count(local)
    if global_batch_size <= 0 and local > 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    return loss.sum() / max(int(global_batch_size), 1)


def scale_regularization_loss(regularization_loss: torch.Tensor) -> torch.Tensor:
    """``regularization_loss / num_replicas_in_sync`` (tf.nn.scale_regularization_loss): a
    penalty on the weights (L2, ...) that every replica adds to its loss is counted once after
    the gradients are summed across replicas."""
    ctx = current.get_replica_context()
    strategy = ctx.strategy if ctx is not None else current.get_strategy()
    if strategy.extended.execution is Execution.GLOBAL:  # one program over the global batch: counted once already
        return regularization_loss
    piecewise = context.global_batch_pieces()
    if piecewise is not None:  # every piece adds the penalty: counted once over the global batch
        return regularization_loss / piecewise[1]
    n = ctx.num_replicas_in_sync if ctx is not None else current.get_strategy().num_replicas_in_sync
    return regularization_loss / n


def examples_in_step(local: int) -> int:
    """The number of examples in this step over all replicas, from this replica's ``local`` (a
    small all-reduce in a replica context with several replicas; runs eagerly, also when
    compiled). Outside a replica context: ``local``."""
    return _global_count(local)


def _global_count(local: int) -> int:
    """The number of examples in this step over all replicas (runs eagerly, also when compiled)."""
    piecewise = context.global_batch_pieces()
    if piecewise is not None:
        return piecewise[0]
    ctx = current.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return local
    return int(ctx.all_reduce("sum", torch.tensor(local, dtype=torch.int64)))


def _global_count_tensor(losses: torch.Tensor) -> torch.Tensor:
    """``_global_count`` of ``losses``' batch as a float32 0-d tensor, at least 1 (for a compiled
    step: the tensor is handed over, not its size, which would specialise the graph)."""
    return torch.tensor(float(max(_global_count(losses.shape[0]), 1)), dtype=torch.float32)


eager_only(sys.modules[__name__], ["_global_count", "_global_count_tensor"])
