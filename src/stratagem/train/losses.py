"""per_example_loss: any ``loss_fn(outputs, y)`` turned into one loss per example of the batch.

``fit`` minimizes the mean loss over the *global* batch. Under data parallelism it needs each
replica's per-example losses (their sum divided by the global batch size, whose gradients summed
over replicas are the global mean's, see ``compute_average_loss``). So:

- a loss returning one value per example (``reduction='none'``) is used as is; one returning
  per-element losses (``[batch, ...]``) is averaged over each example's elements, which is what
  a ``'mean'`` reduction over all elements computes when every example has the same shape;
- a torch loss module (``nn.CrossEntropyLoss()``, ``nn.MSELoss()``, ...) with
  ``reduction='mean'`` is called with ``reduction='none'`` for the duration of the call;
- a function returning a scalar is taken to be the mean over the replica's batch and counts as
  that value for each of its examples (exact for mean-reduced losses).

A ``reduction='sum'`` module is refused (fit would silently change the learning rate scale), and
so are mean reductions that are not plain means: ``CrossEntropyLoss(weight=...)`` and
``NLLLoss(weight=...)`` divide by the summed class weights, ``ignore_index`` by the number of
targets kept; pass a ``reduction='none'`` loss and, if needed, a ``sample_weight`` instead.
A replica whose batch is empty contributes no loss and is never given to ``loss_fn`` (a mean of
nothing is nan), but its (empty) outputs stay in the graph so gradients are still reduced.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stratagem.core import tree

LossFn = Callable[[Any, Any], torch.Tensor]


def check_loss_fn(loss_fn: LossFn) -> None:
    """Refuse loss modules whose reduction fit cannot reproduce exactly across replicas."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(outputs, y); got {type(loss_fn).__name__}")
    reduction = getattr(loss_fn, "reduction", None) if isinstance(loss_fn, nn.Module) else None
    name = type(loss_fn).__name__
    if reduction == "sum":
        raise ValueError(
            f"fit minimizes the mean loss over the global batch but got {name}(reduction='sum'); "
            "use reduction='mean' or 'none' (and scale the learning rate if you meant a sum)"
        )
    if reduction == "mean":
        if getattr(loss_fn, "weight", None) is not None:
            raise ValueError(
                f"{name}(weight=..., reduction='mean') divides by the summed class weights, which "
                "fit cannot split across replicas exactly; use reduction='none' (fit then averages "
                "the weighted per-example losses over the global batch)"
            )
        if getattr(loss_fn, "ignore_index", -100) != -100:
            raise ValueError(
                f"{name}(ignore_index=...) with reduction='mean' averages over the kept targets "
                "only; use reduction='none' and pass a sample_weight mask instead"
            )


_UNREDUCED: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def _unreduced(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` giving one loss per example: for a loss module with ``reduction="mean"``, a
    shallow copy with ``reduction="none"`` (made once, sharing its weights), else itself."""
    if not isinstance(loss_fn, nn.Module) or getattr(loss_fn, "reduction", None) != "mean":
        return loss_fn
    copy_ = _UNREDUCED.get(loss_fn)
    if copy_ is None:
        copy_ = copy.copy(loss_fn)
        setattr(copy_, "reduction", "none")  # noqa: B010 - nn.Module types attributes as tensors
        _UNREDUCED[loss_fn] = copy_
    return copy_


def _zero_connected(outputs: Any, n: int) -> torch.Tensor:
    """A zero loss per example (``n`` of them, 0 when the batch is empty) that depends on outputs."""
    leaves = [t for t in tree.flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        return torch.zeros(n)
    anchor = sum((t.sum() * 0.0 for t in leaves), torch.zeros((), dtype=leaves[0].dtype, device=leaves[0].device))
    return anchor.expand(n) if n else anchor.reshape(1)[:0]


def batch_size(y: Any, outputs: Any) -> int:
    """The batch size of this replica's slice: the leading dimension of ``y`` (or the outputs)."""
    for value in (y, outputs):
        leaves = [t for t in tree.flatten(value)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
        if leaves:
            return int(leaves[0].shape[0])
    raise ValueError(
        f"cannot tell the batch size: y is {tree.signature(y)} and the outputs are "
        f"{tree.signature(outputs)}; give them a leading batch dimension"
    )


def per_example_loss(loss_fn: LossFn, outputs: Any, y: Any) -> torch.Tensor:
    """One loss per example of this replica's batch, shape ``[batch]``."""
    n = batch_size(y, outputs)
    if n == 0:
        return _zero_connected(outputs, 0)
    loss = _unreduced(loss_fn)(outputs, y)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn returned {type(loss).__name__}; it must return a tensor")
    if loss.dim() == 0:
        return loss.expand(n)
    if loss.shape[0] != n:
        raise ValueError(
            f"loss_fn returned a loss of shape {tuple(loss.shape)} for a batch of {n} examples; "
            "return one loss per example (reduction='none') or their mean (a scalar)"
        )
    return loss.flatten(1).mean(dim=1) if loss.dim() > 1 else loss
