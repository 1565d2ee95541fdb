"""Keras's loss names for fit: ``"mse"``, ``"sparse_categorical_crossentropy"``, ...

Each name maps to a per-example loss over the model's raw outputs, as torch's losses take them:
the cross-entropies take **logits** (Keras's default ``from_logits=False`` expects probabilities;
a torch model ends in a Linear layer, not a softmax). Regression losses drop a trailing size-1
axis so ``[B, 1]`` predictions compare with ``[B]`` targets, as Keras does (torch would
broadcast them to ``[B, B]``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F


def _squeezed(outputs: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if outputs.dim() == y.dim() + 1 and outputs.shape[-1] == 1:
        outputs = outputs.squeeze(-1)
    elif y.dim() == outputs.dim() + 1 and y.shape[-1] == 1:
        y = y.squeeze(-1)
    return outputs, y.to(outputs.dtype)


def _per_example(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(dim=1) if x.dim() > 1 else x


def mean_squared_error(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    o, t = _squeezed(outputs, y)
    return _per_example((o - t) ** 2)


def mean_absolute_error(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    o, t = _squeezed(outputs, y)
    return _per_example((o - t).abs())


def huber(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    o, t = _squeezed(outputs, y)
    return _per_example(F.huber_loss(o, t, reduction="none"))


def sparse_categorical_crossentropy(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = y.squeeze(-1) if y.dim() == outputs.dim() and y.shape[-1] == 1 else y
    return F.cross_entropy(outputs, t.long(), reduction="none")


def categorical_crossentropy(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, y.to(outputs.dtype), reduction="none")


def binary_crossentropy(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    o, t = _squeezed(outputs, y)
    return _per_example(F.binary_cross_entropy_with_logits(o, t, reduction="none"))


LOSSES: dict[str, Callable[[Any, Any], torch.Tensor]] = {
    "mse": mean_squared_error,
    "mean_squared_error": mean_squared_error,
    "mae": mean_absolute_error,
    "mean_absolute_error": mean_absolute_error,
    "huber": huber,
    "sparse_categorical_crossentropy": sparse_categorical_crossentropy,
    "categorical_crossentropy": categorical_crossentropy,
    "binary_crossentropy": binary_crossentropy,
}


def resolve(loss: Any) -> Any:
    """``loss`` itself, or the loss a Keras name stands for (a clear error for unknown names)."""
    if not isinstance(loss, str):
        return loss
    fn = LOSSES.get(loss.lower())
    if fn is None:
        raise ValueError(f"unknown loss {loss!r}; pass a callable (outputs, y) -> loss or one of {sorted(LOSSES)}")
    return fn
