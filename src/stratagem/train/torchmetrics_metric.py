"""A torchmetrics metric object in ``metrics=``: its "sum"-reduced states are the totals, summed exactly across replicas.

torchmetrics syncs a metric by gathering every state of every process to every process (its
``dist_reduce_fx`` then reduces them). Here a wrapped metric's states are instead stratagem's
float64 totals: each batch's states (the metric reset, then updated with the batch alone) are
added to this replica's totals, ``stratagem.train.metrics`` sums the totals across replicas in
its one collective, and ``result()`` loads the summed totals into the metric's states and runs its
``compute`` (with torchmetrics' own sync off). That is exact for a state reduced by ``"sum"``,
which is all torchmetrics' counting and summing metrics (accuracy, precision, recall, F-scores,
confusion matrices, thresholded AUROC / average precision, mean and error metrics). Any other
reduction is refused when the metric is given: ``"cat"`` (a list of every prediction) would be
gathered whole to every replica, a cost per rank that grows with the job; ``"mean"`` of
per-replica states is a mean of means; ``"max"`` / ``"min"`` / custom / no reduction are not sums.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem.train.metrics import Metric, _snake_case

__all__ = ["TorchMetric", "is_torchmetric"]


def is_torchmetric(obj: Any) -> bool:
    """Whether ``obj`` is a torchmetrics ``Metric`` (without importing torchmetrics)."""
    return any(c.__module__ == "torchmetrics.metric" and c.__name__ == "Metric" for c in type(obj).__mro__)


def _reduction_name(fn: Any) -> str:
    names = {"dim_zero_sum": "sum", "dim_zero_cat": "cat", "dim_zero_mean": "mean", "dim_zero_max": "max",
             "dim_zero_min": "min"}
    if fn is None:
        return "None"
    return names.get(getattr(fn, "__name__", ""), repr(fn))


class TorchMetric(Metric):
    """A torchmetrics metric as a stratagem ``Metric`` (what ``metrics=[torchmetrics_object]``
    tracks): ``update_state(y_true, y_pred)`` calls its ``update(y_pred, y_true)``; logs under
    its class name in snake case (``BinaryAUROC`` -> ``binary_auroc``) unless ``name`` is given.
    The object is the calculator: read the value from ``result()`` (or fit's logs), not from the
    object's own ``compute()``."""

    additive = False  # the metric's update is not assumed to add over concatenated batches

    def __init__(self, metric: Any, name: str | None = None) -> None:
        if not is_torchmetric(metric):
            raise TypeError(f"TorchMetric wraps a torchmetrics.Metric; got {type(metric).__name__}")
        self.wrapped = metric
        self._states: list[tuple[Any, str, torch.Size, torch.dtype]] = []
        for module in metric.modules():
            if not is_torchmetric(module):
                continue
            for attr, fn in module._reductions.items():
                default = module._defaults[attr]
                reduction = _reduction_name(fn)
                if reduction != "sum" or not isinstance(default, torch.Tensor):
                    raise ValueError(_refusal(metric, module, attr, reduction))
                self._states.append((module, attr, default.shape, default.dtype))
            module._to_sync = False  # stratagem sums the states; torchmetrics must not gather them too
            module.sync_on_compute = False
        if not self._states:
            raise ValueError(f"{type(metric).__name__} has no metric states to sum across replicas")
        self.num_totals = sum(shape.numel() for _, _, shape, _ in self._states)
        super().__init__(name if name is not None else _snake_case(type(metric).__name__))

    def batch_totals(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        if sample_weight is not None:
            raise ValueError(
                f"{type(self.wrapped).__name__} is a torchmetrics metric, which takes no sample weights; give it in "
                "metrics= (updated without weights, as Keras does), not weighted_metrics=")
        tm = self.wrapped
        device = y_pred.device if isinstance(y_pred, torch.Tensor) else None
        if device is not None and tm.device != device:
            tm.to(device)
        tm.reset()
        with torch.no_grad():
            tm.update(y_pred, y_true)
        parts = []
        for module, attr, shape, _ in self._states:
            value = getattr(module, attr)
            if not isinstance(value, torch.Tensor) or value.shape != shape:
                raise ValueError(
                    f"{type(self.wrapped).__name__}'s state {attr!r} changed shape in update (from {tuple(shape)} to "
                    f"{tuple(getattr(value, 'shape', ()))}); a state summed across replicas must keep its shape "
                    "(give the metric its sizes, e.g. num_classes=)")
            parts.append(value.detach().to(torch.float64).reshape(-1))
        return torch.cat(parts)

    def compute(self, totals: torch.Tensor) -> Any:
        tm = self.wrapped
        offset = 0
        for module, attr, shape, dtype in self._states:
            n = shape.numel()
            part = totals[offset : offset + n].reshape(shape)
            if not dtype.is_floating_point:
                part = part.round()
            setattr(module, attr, part.to(device=tm.device, dtype=dtype))
            offset += n
        for module in tm.modules():
            if is_torchmetric(module):
                module._computed = None
                module._update_count = max(module._update_count, 1)
        with torch.no_grad():
            return tm.compute()

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name}

    def __repr__(self) -> str:
        return f"TorchMetric({self.wrapped!r}, name={self.name!r})"


def _refusal(metric: Any, module: Any, attr: str, reduction: str) -> str:
    owner = type(metric).__name__ if module is metric else f"{type(metric).__name__} (its {type(module).__name__})"
    why = {
        "cat": "its values are concatenated: across replicas every prediction of every replica would be gathered "
               "to every replica, a cost per rank that grows with the job, and stratagem sums totals instead",
        "mean": "a mean of the replicas' states is a mean of means, not the one-device value",
        "max": "a maximum is not a sum of totals", "min": "a minimum is not a sum of totals",
        "None": "it has no reduction across processes",
    }.get(reduction, "a custom reduction cannot be made a sum of totals")
    return (
        f"{owner}: state {attr!r} is reduced by {reduction!r} and {why}; stratagem accepts torchmetrics metrics "
        "whose states are all reduced by 'sum' (exact across replicas). Use the metric's counting form (e.g. "
        "BinaryAUROC(thresholds=200), whose state is a confusion matrix per threshold) or a stratagem metric "
        "(stratagem.metrics.AUC, Precision, Recall, F1Score, MeanIoU)"
    )
