"""Sample weights as Keras shapes them against one loss per example: ``(N,)``, ``(N, 1)`` or a scalar.

Keras squeezes or expands the weights to the rank of the losses before multiplying
(``squeeze_or_expand_to_same_rank``), so ``(N, 1)`` weights, the shape of a column of a table and
the one Keras's guides use, weigh ``(N,)`` losses example by example. torch would broadcast
``(N,)`` against ``(N, 1)`` into an ``(N, N)`` matrix: a loss of ``mean(loss) * mean(w)`` and a
gradient ``N`` times too large, without a word. Every place that weighs losses goes through
``per_example`` here, which gives ``(N,)`` or a clear error naming both shapes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["per_example", "weigh"]


def per_example(sample_weight: Any, n: int, like: torch.Tensor | None = None) -> torch.Tensor | None:
    """``sample_weight`` as one weight per example, shape ``(n,)`` (None stays None).

    A scalar weighs every example alike; ``(n,)`` is used as it is; ``(n, 1)`` (or ``(n, 1, 1)``)
    is squeezed as Keras squeezes it. Anything else is an error that names the weights' shape and
    the losses'. ``like``: the dtype and device to give the weights (the losses')."""
    if sample_weight is None:
        return None
    if isinstance(sample_weight, torch.Tensor):
        w = sample_weight
    else:
        w = torch.as_tensor(sample_weight)
    if like is not None:
        w = w.to(device=like.device, dtype=like.dtype if like.is_floating_point() else w.dtype)
    if w.dim() == 0:
        return w.expand(n)
    if w.shape[0] == n and all(d == 1 for d in w.shape[1:]):
        return w.reshape(n)
    shape = tuple(w.shape)
    hint = (
        f"give one weight per example: shape ({n},) or ({n}, 1)"
        if w.shape[0] == n
        else f"the batch has {n} examples and the weights {shape[0]} rows; give one weight per example"
    )
    raise ValueError(
        f"sample_weight has shape {shape} but the loss has one value per example, shape ({n},): {hint} "
        "(per-element weights of a sequence, (N, T), need a loss that keeps its time axis)"
    )


def weigh(losses: torch.Tensor, sample_weight: Any) -> torch.Tensor:
    """``losses`` (one per example, ``(N,)``) times their weights (``per_example``'s shapes)."""
    w = per_example(sample_weight, int(losses.shape[0]) if losses.dim() else 1, losses)
    if w is None:
        return losses
    return losses * w if losses.dim() else losses * w.reshape(())
