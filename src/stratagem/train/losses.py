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


_CHECKED: weakref.WeakSet[Any] = weakref.WeakSet()


def _rows(value: Any, a: int, b: int) -> Any:
    return tree.map_structure(lambda t: t[a:b] if isinstance(t, torch.Tensor) and t.dim() else t, value)


def _check_mean(loss_fn: LossFn, outputs: Any, y: Any, loss: torch.Tensor, n: int) -> None:
    """Once per loss function returning a scalar: is it the batch's mean (as fit assumes) or
    its sum? Compared on the two halves of the batch (no gradients); a sum is refused, since
    fit would train with another effective learning rate on each number of replicas."""
    try:
        if loss_fn in _CHECKED or n < 2:
            return
        _CHECKED.add(loss_fn)
    except TypeError:  # not weak-referenceable: checked every call would cost too much
        return
    h = n // 2
    try:
        with torch.no_grad():
            halves = [float(loss_fn(_rows(outputs, a, b), _rows(y, a, b))) for a, b in ((0, h), (h, n))]
    except Exception:  # noqa: BLE001 - a loss that cannot run on half a batch: nothing to learn
        return
    whole = float(loss.detach())
    as_mean = (h * halves[0] + (n - h) * halves[1]) / n
    as_sum = halves[0] + halves[1]
    tol = 1e-4 * max(abs(whole), 1e-12)
    if abs(whole - as_sum) <= tol and abs(whole - as_mean) > 100 * tol:
        raise ValueError(
            f"loss_fn returned the sum of the batch's losses ({whole:.6g} = the sum of its halves' "
            f"{halves[0]:.6g} + {halves[1]:.6g}); fit minimizes the mean over the global batch and "
            "takes a scalar loss to be the batch mean, so a sum would give other parameters on "
            "each number of replicas. Return the mean (reduction='mean') or one loss per example "
            "(reduction='none'); in a custom step, use compute_average_loss(per_example_losses)"
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
        _check_mean(loss_fn, outputs, y, loss, n)
        return loss.expand(n)
    if loss.shape[0] != n:
        raise ValueError(
            f"loss_fn returned a loss of shape {tuple(loss.shape)} for a batch of {n} examples; "
            "return one loss per example (reduction='none') or their mean (a scalar)"
        )
    return loss.flatten(1).mean(dim=1) if loss.dim() > 1 else loss
