"""per_example_loss: any ``loss_fn(outputs, y)`` turned into one loss per example of the batch;
and Keras's loss classes (``Loss``, ``SparseCategoricalCrossentropy(from_logits=...)``, ...).

Which argument order: a Keras loss (an instance of ``Loss`` here, or a Keras name such as
``"sparse_categorical_crossentropy"``, which stands for one) is called as Keras calls it,
``call(y_true, y_pred)``; a torch loss (an ``nn.Module`` such as ``nn.CrossEntropyLoss()``, or any
other callable) as torch calls it, ``loss_fn(outputs, y)``. Likewise ``from_logits``: a Keras
cross-entropy takes probabilities unless ``from_logits=True`` (Keras's default), a torch one
takes logits; the Keras cross-entropies check their first batch and raise on a contradiction.

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
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stratagem.core import tree
from stratagem.core.eager import eager_only
from stratagem.core.sample_weights import weigh

LossFn = Callable[[Any, Any], torch.Tensor]


def check_loss_fn(loss_fn: LossFn) -> None:
    """Refuse loss modules whose reduction fit cannot reproduce exactly across replicas."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(outputs, y); got {type(loss_fn).__name__}")
    if isinstance(loss_fn, Loss):
        if loss_fn.reduction in ("sum", "mean_with_sample_weight"):
            raise ValueError(
                f"fit minimizes the mean loss over the global batch (Keras's reduction="
                f"'sum_over_batch_size') but got {loss_fn!r}; {loss_fn.reduction!r} would give another "
                "objective on each number of replicas. Use reduction='sum_over_batch_size' (the default)"
            )
        return
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


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape ``a`` and ``b`` broadcast to, None when they do not (plain Python: no tensor op,
    so a compiled step traces it without a graph break or a fake-tensor error)."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        z = b[-i] if i <= len(b) else 1
        if x != z and x != 1 and z != 1:
            return None
        out.append(z if x == 1 else x)
    return tuple(reversed(out))


def check_shapes(loss_fn: LossFn, outputs: Any, y: Any) -> None:
    """A torch loss given outputs and targets that broadcast to a shape neither has (``[B, 1]``
    against ``[B]`` gives ``[B, B]``: every output compared with every target, a silently wrong
    loss that torch only warns about) is an error naming both shapes. Keras's losses match such
    shapes themselves (``_same_rank``); a torch loss is given them as they are."""
    if not (isinstance(outputs, torch.Tensor) and isinstance(y, torch.Tensor)) or outputs.shape == y.shape:
        return
    both = _broadcast(tuple(outputs.shape), tuple(y.shape))
    if both is None:  # cannot broadcast: the loss itself says so (or needs them so, e.g. class ids)
        return
    numel = math.prod(both)
    if both == tuple(outputs.shape) or both == tuple(y.shape) or numel <= max(outputs.numel(), y.numel()):
        return
    name = type(loss_fn).__name__ if isinstance(loss_fn, nn.Module) else getattr(loss_fn, "__name__", type(loss_fn).__name__)
    o, t = list(outputs.shape), list(y.shape)
    if outputs.dim() == y.dim() + 1 and outputs.shape[-1] == 1:
        fix = "give the targets the outputs' shape (y.unsqueeze(-1)) or squeeze the outputs (outputs.squeeze(-1))"
    elif y.dim() == outputs.dim() + 1 and y.shape[-1] == 1:
        fix = "give the outputs the targets' shape (outputs.unsqueeze(-1)) or squeeze the targets (y.squeeze(-1))"
    else:
        fix = "make the outputs and the targets the same shape"
    raise ValueError(
        f"loss_fn {name} got outputs of shape {o} and targets of shape {t}: torch broadcasts them "
        f"to {list(both)}, comparing every output with every target (a wrong loss, trained on "
        f"without an error); {fix}. Keras's losses (stratagem.losses.MeanSquaredError(), "
        "loss='mse') match such shapes as Keras does"
    )


def per_example_loss(loss_fn: LossFn, outputs: Any, y: Any, sample_weight: Any = None) -> torch.Tensor:
    """One loss per example of this replica's batch, shape ``[batch]``; with ``sample_weight``,
    weighted as Keras weighs them: one weight per example (``(N,)``, ``(N, 1)``), or one per
    element of a loss that keeps more axes (``(N, T)`` for a sequence's per-step losses: each
    example's loss is then the mean over its elements of ``w * loss``, so the batch's mean is
    Keras's ``sum(w * loss) / (N * T)``); any other shape an error naming both."""
    loss = _per_element_loss(loss_fn, outputs, y)
    if sample_weight is not None:
        return _weighted(loss, sample_weight)
    return loss.flatten(1).mean(dim=1) if loss.dim() > 1 else loss


def _weighted(loss: torch.Tensor, sample_weight: Any) -> torch.Tensor:
    n = int(loss.shape[0])
    w = torch.as_tensor(sample_weight, device=loss.device)
    loss = loss.float()
    if loss.dim() > 1 and w.dim() > 1 and w.shape[0] == n:
        if w.dim() == loss.dim() + 1 and w.shape[-1] == 1:
            w = w.squeeze(-1)  # (N, T, 1) weights against (N, T) losses, as Keras squeezes them
        if tuple(w.shape) == tuple(loss.shape):
            return (loss * w.to(loss.dtype)).flatten(1).mean(dim=1)
        if not all(d == 1 for d in w.shape[1:]):
            raise ValueError(
                f"sample_weight has shape {tuple(w.shape)} but the loss has shape {tuple(loss.shape)} (one value per "
                f"element): give one weight per example, ({n},), or one per element, {tuple(loss.shape)}"
            )
    per = loss.flatten(1).mean(dim=1) if loss.dim() > 1 else loss
    return weigh(per, w)


def _per_element_loss(loss_fn: LossFn, outputs: Any, y: Any) -> torch.Tensor:
    """The loss of each example, ``[batch]``, or of each element, ``[batch, ...]``."""
    n = batch_size(y, outputs)
    if n == 0:
        return _zero_connected(outputs, 0)
    if isinstance(loss_fn, Loss):  # Keras's order: labels first
        loss = loss_fn.per_example(y, outputs)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"{type(loss_fn).__name__}.call returned {type(loss).__name__}; it must return a tensor")
        if loss.dim() == 0:
            return loss.expand(n)
        if loss.shape[0] != n:
            raise ValueError(
                f"{type(loss_fn).__name__}.call returned a loss of shape {tuple(loss.shape)} for a batch of {n} "
                "examples; return one loss per example (or per element, [batch, ...])"
            )
        return loss
    check_shapes(loss_fn, outputs, y)
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
    return loss


# --- Keras's loss classes: call(y_true, y_pred), reduction, from_logits ----------------------------
#
# A Keras loss is called as Keras calls it, ``loss(y_true, y_pred, sample_weight=None)``, and a
# subclass implements ``call(self, y_true, y_pred)``: the labels come first. A torch loss (an
# ``nn.Module`` such as ``nn.CrossEntropyLoss()``, or a plain function) is called as torch calls it,
# ``loss_fn(outputs, y)``. fit decides by what the user wrote: an instance of ``Loss`` below (and
# a Keras name such as ``"sparse_categorical_crossentropy"``, which stands for one), and a plain
# function whose first parameters are named ``y_true, y_pred`` (a custom loss as the Keras guides
# write it) get ``(y, outputs)``; anything else gets ``(outputs, y)``.

#: Keras's epsilon: probabilities are clipped to ``[EPSILON, 1 - EPSILON]`` before the log.
EPSILON = 1e-7

_REDUCTIONS = ("sum_over_batch_size", "sum", "mean", "mean_with_sample_weight", "none", None)


class Reduction:
    """TF 2's ``tf.keras.losses.Reduction`` names (Keras 3 takes the strings themselves)."""

    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"
    AUTO = "sum_over_batch_size"


class Loss:
    """Keras's loss base class: subclass it and implement ``call(self, y_true, y_pred)``, returning
    one loss per example (or per element; they are averaged per example).

    Called directly, ``loss(y_true, y_pred, sample_weight=None)`` reduces as Keras does:
    ``"sum_over_batch_size"`` (the default; also ``"mean"``) is ``sum(w * loss) / n`` over the
    ``n`` loss values, ``"sum"`` the sum, ``"mean_with_sample_weight"`` divides by ``sum(w)``,
    ``"none"``/``None`` returns the values. Passed to ``fit``/``evaluate``, its ``call`` gives the
    per-example losses and fit minimizes their mean over the global batch, which is Keras's
    ``"sum_over_batch_size"``; ``"sum"`` and ``"mean_with_sample_weight"`` are refused there (they
    would give another objective on each number of replicas).
    """

    def __init__(self, name: str | None = None, reduction: str | None = "sum_over_batch_size", dtype: Any = None) -> None:
        if reduction not in _REDUCTIONS:
            raise ValueError(f"Invalid value for argument `reduction`. Expected one of {_REDUCTIONS}. Received: reduction={reduction!r}")
        self.name = name or _snake(type(self).__name__)
        self.reduction = reduction
        self.dtype = dtype if dtype is not None else torch.float32

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement call(self, y_true, y_pred)")

    def per_example(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        """``call``'s values in the loss's dtype (what fit reduces per example)."""
        return self.call(_as_float(y_true, self.dtype, like=y_pred), _as_float(y_pred, self.dtype))

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        values = self.per_example(y_true, y_pred)
        return _reduce(values, sample_weight, self.reduction)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "reduction": self.reduction}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Loss:
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        return f"{type(self).__name__}({args})"


def _snake(name: str) -> str:
    out = "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
    return out


def _as_float(value: Any, dtype: torch.dtype, like: Any = None) -> Any:
    """``value`` as a tensor; floating tensors of lower precision in ``dtype`` (Keras computes
    losses in float32); labels keep their integer type (sparse labels are class ids)."""
    t = torch.as_tensor(value, device=like.device if isinstance(like, torch.Tensor) else None) if not isinstance(value, torch.Tensor) else value
    if t.is_floating_point() and t.dtype != dtype and t.dtype != torch.float64:
        t = t.to(dtype)
    return t


def _reduce(values: torch.Tensor, sample_weight: Any, reduction: str | None) -> torch.Tensor:
    """Keras's ``reduce_weighted_values``: weights broadcast against the values, then reduced."""
    if sample_weight is not None:
        w = torch.as_tensor(sample_weight, dtype=values.dtype, device=values.device)
        while w.dim() < values.dim():
            w = w.unsqueeze(-1)
        while w.dim() > values.dim() and w.shape[-1] == 1:
            w = w.squeeze(-1)
        values = values * w
    if reduction in (None, "none") or values.dim() == 0:
        return values
    total = values.sum()
    if reduction == "sum":
        return total
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        divisor = torch.as_tensor(sample_weight, dtype=values.dtype, device=values.device).sum()
    else:
        divisor = torch.tensor(float(values.numel()), dtype=values.dtype, device=values.device)
    return torch.where(divisor != 0, total / divisor, torch.zeros_like(total))


def _same_rank(y_true: torch.Tensor, y_pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keras's ``squeeze_or_expand_to_same_rank(y_true, y_pred)``: ``[B]`` labels against
    ``[B, 1]`` predictions become ``[B, 1]`` (and the reverse), never broadcast to ``[B, B]``."""
    if y_pred.dim() == y_true.dim() + 1 and y_pred.shape[-1] == 1:
        y_true = y_true.unsqueeze(-1) if y_true.dim() == 1 else y_true
        if y_true.dim() != y_pred.dim():
            y_pred = y_pred.squeeze(-1)
    elif y_true.dim() == y_pred.dim() + 1 and y_true.shape[-1] == 1:
        y_pred = y_pred.unsqueeze(-1) if y_pred.dim() == 1 else y_pred
        if y_true.dim() != y_pred.dim():
            y_true = y_true.squeeze(-1)
    return y_true, y_pred


# --- Keras's loss functions (y_true, y_pred): per-example values, as keras.losses.* ----------------
def mean_squared_error(y_true: Any, y_pred: Any) -> torch.Tensor:
    """Keras's ``mean_squared_error``: the mean over the last axis of ``(y_pred - y_true)**2``."""
    y_pred = torch.as_tensor(y_pred)
    y_true, y_pred = _same_rank(torch.as_tensor(y_true, device=y_pred.device).to(y_pred.dtype), y_pred)
    return ((y_pred - y_true) ** 2).mean(dim=-1)


def mean_absolute_error(y_true: Any, y_pred: Any) -> torch.Tensor:
    """Keras's ``mean_absolute_error``: the mean over the last axis of ``|y_pred - y_true|``."""
    y_pred = torch.as_tensor(y_pred)
    y_true, y_pred = _same_rank(torch.as_tensor(y_true, device=y_pred.device).to(y_pred.dtype), y_pred)
    return (y_pred - y_true).abs().mean(dim=-1)


def huber(y_true: Any, y_pred: Any, delta: float = 1.0) -> torch.Tensor:
    """Keras's ``huber``: the mean over the last axis of the Huber loss."""
    y_pred = torch.as_tensor(y_pred)
    y_true, y_pred = _same_rank(torch.as_tensor(y_true, device=y_pred.device).to(y_pred.dtype), y_pred)
    return torch.nn.functional.huber_loss(y_pred, y_true, reduction="none", delta=delta).mean(dim=-1)


def _probability_check(loss: str, y_pred: torch.Tensor, from_logits: bool, binary: bool) -> None:
    """The contradictions a first batch shows: probabilities expected and not given (a model
    without a softmax/sigmoid), or logits expected and exact probability rows given."""
    with torch.no_grad():
        p = y_pred.detach()
        if p.numel() == 0 or not p.is_floating_point():
            return
        p = p.float()
        lo, hi = float(p.min()), float(p.max())
        fix_logits = (
            f"pass from_logits=True (loss=sg.losses.{loss}(from_logits=True)) or use a torch loss, "
            + ("nn.BCEWithLogitsLoss()" if binary else "nn.CrossEntropyLoss()")
            + f", which takes logits; or end the model in {'nn.Sigmoid()' if binary else 'nn.Softmax(dim=-1)'}"
        )
        if binary:
            if not from_logits and (lo < 0.0 or hi > 1.0):
                raise ValueError(
                    f"{loss}(from_logits=False), Keras's default and what the name 'binary_crossentropy' "
                    f"means, expects probabilities in [0, 1]; the model's outputs on the first batch "
                    f"range over [{lo:.4g}, {hi:.4g}], so they are logits. To train on logits, {fix_logits}"
                )
            return
        if p.dim() == 0 or p.shape[-1] < 2:
            return
        sums = p.sum(dim=-1)
        off = float((sums - 1.0).abs().max())
        tol = 1e-3 if y_pred.dtype in (torch.float32, torch.float64) else 2e-2
        if not from_logits and (lo < 0.0 or off > tol):
            name = "sparse_categorical_crossentropy" if loss.startswith("Sparse") else "categorical_crossentropy"
            raise ValueError(
                f"{loss}(from_logits=False), Keras's default and what the name {name!r} means, "
                f"expects probabilities (each row of the model's outputs a distribution over the "
                f"classes); on the first batch the outputs range over [{lo:.4g}, {hi:.4g}] and their "
                f"rows sum to {float(sums.min()):.4g}..{float(sums.max()):.4g}, so they are logits. To "
                f"train on logits, {fix_logits}"
            )
        if from_logits and lo >= 0.0 and hi <= 1.0 and off <= 1e-4:
            raise ValueError(
                f"{loss}(from_logits=True) expects logits, but every row of the model's outputs on "
                "the first batch is a probability distribution (non-negative, summing to 1): the "
                "model ends in a softmax, and from_logits=True would apply another one. Pass "
                f"from_logits=False (sg.losses.{loss}(), Keras's default), or drop the model's final "
                "softmax"
            )


def categorical_crossentropy(
    y_true: Any, y_pred: Any, from_logits: bool = False, label_smoothing: float = 0.0, axis: int = -1
) -> torch.Tensor:
    """Keras's ``categorical_crossentropy`` (one-hot ``y_true``): probabilities by default
    (normalized over ``axis``, clipped to ``[1e-7, 1 - 1e-7]``), logits with ``from_logits=True``."""
    y_pred = torch.as_tensor(y_pred)
    y_true = torch.as_tensor(y_true, device=y_pred.device).to(y_pred.dtype)
    if y_true.shape != y_pred.shape:
        raise ValueError(
            f"Arguments `target` and `output` must have the same shape. Received: target.shape={tuple(y_true.shape)}, "
            f"output.shape={tuple(y_pred.shape)} (one-hot labels; use sparse_categorical_crossentropy for class ids)"
        )
    if label_smoothing:
        y_true = y_true * (1.0 - label_smoothing) + label_smoothing / y_pred.shape[axis]
    if from_logits:
        log_prob = torch.log_softmax(y_pred, dim=axis)
    else:
        out = y_pred / y_pred.sum(dim=axis, keepdim=True)
        log_prob = torch.log(out.clamp(EPSILON, 1.0 - EPSILON))
    return -(y_true * log_prob).sum(dim=axis)


def sparse_categorical_crossentropy(
    y_true: Any, y_pred: Any, from_logits: bool = False, ignore_class: int | None = None, axis: int = -1
) -> torch.Tensor:
    """Keras's ``sparse_categorical_crossentropy`` (class ids ``y_true``, classes on ``axis``, the
    last by default): probabilities by default, logits with ``from_logits=True``; examples
    labelled ``ignore_class`` give 0."""
    y_pred = torch.as_tensor(y_pred)
    target = torch.as_tensor(y_true, device=y_pred.device)
    if target.dim() == y_pred.dim() and target.shape[axis] == 1:
        target = target.squeeze(axis)
    target = target.long()
    out = y_pred.movedim(axis, 1) if y_pred.dim() > 1 else y_pred.unsqueeze(0)
    t = target if y_pred.dim() > 1 else target.reshape(1)
    valid = None
    if ignore_class is not None:
        valid = t != ignore_class
        t = torch.where(valid, t, torch.zeros_like(t))
    if tuple(t.shape) != (out.shape[0], *out.shape[2:]):
        raise ValueError(
            "Arguments `target` and `output` must have the same shape up until the last dimension: "
            f"target.shape={tuple(target.shape)}, output.shape={tuple(y_pred.shape)}"
        )
    if from_logits:
        result = torch.nn.functional.cross_entropy(out, t, reduction="none")
    else:
        probs = out / out.sum(dim=1, keepdim=True)
        result = torch.nn.functional.nll_loss(torch.log(probs.clamp(EPSILON, 1.0 - EPSILON)), t, reduction="none")
    if valid is not None:
        result = torch.where(valid, result, torch.zeros_like(result))
    return result if y_pred.dim() > 1 else result.squeeze(0)


def binary_crossentropy(
    y_true: Any, y_pred: Any, from_logits: bool = False, label_smoothing: float = 0.0, axis: int = -1
) -> torch.Tensor:
    """Keras's ``binary_crossentropy``: the mean over ``axis`` of the element-wise binary
    cross-entropy of probabilities (clipped to ``[1e-7, 1 - 1e-7]``), or of logits with
    ``from_logits=True``."""
    y_pred = torch.as_tensor(y_pred)
    y_true, y_pred = _same_rank(torch.as_tensor(y_true, device=y_pred.device).to(y_pred.dtype), y_pred)
    if label_smoothing:
        y_true = y_true * (1.0 - label_smoothing) + 0.5 * label_smoothing
    if from_logits:
        values = torch.nn.functional.binary_cross_entropy_with_logits(y_pred, y_true, reduction="none")
    else:
        # Keras's formula, which also takes labels outside [0, 1] (a GAN's noisy labels; torch's refuses them)
        p = y_pred.clamp(EPSILON, 1.0 - EPSILON)
        values = -(y_true * torch.log(p) + (1.0 - y_true) * torch.log(1.0 - p))
    return values.mean(dim=axis)


for _fn in (mean_squared_error, mean_absolute_error, huber, categorical_crossentropy,
            sparse_categorical_crossentropy, binary_crossentropy):  # fmt: skip
    _fn.keras_order = True  # type: ignore[attr-defined]  # called (y_true, y_pred), see resolve below
del _fn


class LossFunctionWrapper(Loss):
    """A Keras-order function ``fn(y_true, y_pred, **kwargs)`` as a Loss (Keras's class)."""

    def __init__(self, fn: Callable[..., torch.Tensor], reduction: str | None = "sum_over_batch_size",
                 name: str | None = None, dtype: Any = None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(name=name or getattr(fn, "__name__", None), reduction=reduction, dtype=dtype)
        self.fn = fn
        self._fn_kwargs = kwargs

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return self.fn(y_true, y_pred, **self._fn_kwargs)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **self._fn_kwargs}


class MeanSquaredError(LossFunctionWrapper):
    def __init__(self, reduction: str | None = "sum_over_batch_size", name: str = "mean_squared_error", dtype: Any = None) -> None:
        super().__init__(mean_squared_error, reduction=reduction, name=name, dtype=dtype)

    def get_config(self) -> dict[str, Any]:
        return Loss.get_config(self)


class MeanAbsoluteError(LossFunctionWrapper):
    def __init__(self, reduction: str | None = "sum_over_batch_size", name: str = "mean_absolute_error", dtype: Any = None) -> None:
        super().__init__(mean_absolute_error, reduction=reduction, name=name, dtype=dtype)

    def get_config(self) -> dict[str, Any]:
        return Loss.get_config(self)


class Huber(LossFunctionWrapper):
    def __init__(self, delta: float = 1.0, reduction: str | None = "sum_over_batch_size", name: str = "huber_loss", dtype: Any = None) -> None:
        super().__init__(huber, reduction=reduction, name=name, dtype=dtype, delta=delta)


class _Crossentropy(LossFunctionWrapper):
    """The cross-entropies: on the first batch they have values for, the outputs are checked
    against ``from_logits`` (probabilities for False, Keras's default; not exact probability
    rows for True), and a contradiction is a ValueError saying what to write."""

    _binary = False

    def __init__(self, fn: Callable[..., torch.Tensor], from_logits: bool, reduction: str | None, name: str,
                 dtype: Any, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(fn, reduction=reduction, name=name, dtype=dtype, from_logits=from_logits, **kwargs)
        self.from_logits = from_logits
        self._checked = False

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        self._check_first(y_pred)
        return super().call(y_true, y_pred)

    def _check_first(self, y_pred: Any) -> None:
        """The probability check on the first batch (eager in a compiled step: the flag read
        there would specialise the graph on it, a recompilation after the first batch)."""
        if not self._checked and isinstance(y_pred, torch.Tensor) and y_pred.numel():
            _probability_check(type(self).__name__, y_pred, self.from_logits, self._binary)
            self._checked = True


class SparseCategoricalCrossentropy(_Crossentropy):
    """Keras's ``SparseCategoricalCrossentropy(from_logits=False, ignore_class=None)``: class-id
    labels, probabilities by default (``from_logits=True`` for logits)."""

    def __init__(self, from_logits: bool = False, ignore_class: int | None = None, reduction: str | None = "sum_over_batch_size",
                 name: str = "sparse_categorical_crossentropy", dtype: Any = None) -> None:  # fmt: skip
        super().__init__(sparse_categorical_crossentropy, from_logits, reduction, name, dtype, ignore_class=ignore_class)


class CategoricalCrossentropy(_Crossentropy):
    """Keras's ``CategoricalCrossentropy(from_logits=False, label_smoothing=0.0, axis=-1)``: one-hot
    labels, probabilities by default (``from_logits=True`` for logits)."""

    def __init__(self, from_logits: bool = False, label_smoothing: float = 0.0, axis: int = -1,
                 reduction: str | None = "sum_over_batch_size", name: str = "categorical_crossentropy",
                 dtype: Any = None) -> None:  # fmt: skip
        super().__init__(categorical_crossentropy, from_logits, reduction, name, dtype, label_smoothing=label_smoothing, axis=axis)


class BinaryCrossentropy(_Crossentropy):
    """Keras's ``BinaryCrossentropy(from_logits=False, label_smoothing=0.0, axis=-1)``:
    probabilities by default (``from_logits=True`` for logits)."""

    _binary = True

    def __init__(self, from_logits: bool = False, label_smoothing: float = 0.0, axis: int = -1,
                 reduction: str | None = "sum_over_batch_size", name: str = "binary_crossentropy",
                 dtype: Any = None) -> None:  # fmt: skip
        super().__init__(binary_crossentropy, from_logits, reduction, name, dtype, label_smoothing=label_smoothing, axis=axis)


#: Keras's loss names (``loss="..."``): each stands for a new instance of its class, so a name
#: means what it means in Keras (the cross-entropies take probabilities: ``from_logits=False``).
KERAS_NAMES: dict[str, Callable[[], Loss]] = {
    "mse": MeanSquaredError,
    "mean_squared_error": MeanSquaredError,
    "mae": MeanAbsoluteError,
    "mean_absolute_error": MeanAbsoluteError,
    "huber": Huber,
    "huber_loss": Huber,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "binary_crossentropy": BinaryCrossentropy,
}


def get(identifier: Any) -> Any:
    """Keras's ``losses.get``: a Keras name as its Loss (a new instance), a Keras-order function of
    this module as a ``LossFunctionWrapper``, anything else (a Loss, a torch loss) as given."""
    if isinstance(identifier, str):
        make = KERAS_NAMES.get(identifier.lower())
        if make is None:
            raise ValueError(
                f"unknown loss {identifier!r}; pass a callable (outputs, y) -> loss (a torch loss), a "
                f"stratagem.losses.Loss, or one of {sorted(KERAS_NAMES)}"
            )
        return make()
    if getattr(identifier, "keras_order", False) and not isinstance(identifier, Loss):
        return LossFunctionWrapper(identifier)
    if _written_keras_order(identifier):
        return LossFunctionWrapper(identifier)
    return identifier


def _written_keras_order(fn: Any) -> bool:
    """A plain function whose first two parameters are named ``y_true, y_pred`` (Keras's custom
    loss function, as the Keras guides write it): called labels first, as the user wrote it. A torch
    loss (an ``nn.Module``) and any other function keep torch's ``(outputs, y)``."""
    import inspect

    if isinstance(fn, (Loss, torch.nn.Module)) or not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        return False
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return params[:2] == ["y_true", "y_pred"]


# the first batch's check reads values back (a graph break and dynamo's warning in a compiled
# step) and a flag: it runs eagerly
eager_only(_Crossentropy, ["_check_first"])
