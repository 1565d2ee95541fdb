"""Keras's count-based metrics (AUC, Precision, Recall, F-scores, IoU, sparse top-k): float64 confusion counts summed across replicas.

Each metric's state is the confusion counts Keras 3 keeps (true/false positives/negatives per
threshold, a confusion matrix), as stratagem's float64 totals: summed across replicas by the
machinery of :mod:`stratagem.train.metrics`, so the value under N replicas is the one-device
value on the same examples (never a mean of per-replica values). The counts follow Keras's own
steps (its threshold placement, its bucketing of predictions in the metric's dtype, its rank
matching of labels, predictions and weights); the counts are kept in float64 where Keras keeps
float32, so the results agree with Keras to float32 rounding.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stratagem.train.metrics import Metric, _per_example_mean, _PerExample, _tensor, in_top_k

__all__ = [
    "AUC",
    "F1Score",
    "FBetaScore",
    "FalseNegatives",
    "FalsePositives",
    "IoU",
    "MeanIoU",
    "Precision",
    "Recall",
    "SparseTopKCategoricalAccuracy",
    "TrueNegatives",
    "TruePositives",
    "confusion_counts",
]

#: Keras's backend.epsilon()
EPSILON = 1e-7
#: Keras's metrics_utils.NEG_INF: the threshold of top_k precision / recall
NEG_INF = -1e10


def _same_rank(x1: torch.Tensor, x2: torch.Tensor, expand_rank_1: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Keras's ``squeeze_or_expand_to_same_rank``: a trailing axis of 1 dropped (or added)."""
    r1, r2 = x1.dim(), x2.dim()
    if r1 == r2:
        return x1, x2
    if r1 == r2 + 1 and x1.shape[-1] == 1:
        if r2 == 1 and expand_rank_1:
            x2 = x2.unsqueeze(-1)
        else:
            x1 = x1.squeeze(-1)
    if r2 == r1 + 1 and x2.shape[-1] == 1:
        if r1 == 1 and expand_rank_1:
            x1 = x1.unsqueeze(-1)
        else:
            x2 = x2.squeeze(-1)
    return x1, x2


def _broadcast(w: torch.Tensor, shape: torch.Size, what: str) -> torch.Tensor:
    try:
        return torch.broadcast_to(w, shape)
    except RuntimeError as e:
        raise ValueError(
            f"{what}: sample_weight of shape {tuple(w.shape)} does not broadcast to the predictions' shape "
            f"{tuple(shape)}; give one weight per example ({shape[0] if len(shape) else 1},) or weights shaped "
            "like the predictions"
        ) from e


def _filter_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """Keras's ``_filter_top_k``: the ``k`` highest values of the last axis kept, the rest NEG_INF."""
    idx = x.topk(min(k, x.shape[-1]), dim=-1).indices
    mask = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx, True)
    return torch.where(mask, x, torch.full_like(x, NEG_INF))


def is_evenly_distributed(thresholds: Sequence[float]) -> bool:
    """Keras's ``is_evenly_distributed_thresholds`` (then it buckets instead of comparing)."""
    n = len(thresholds)
    if n < 3:
        return False
    return bool(np.allclose(thresholds, np.arange(n, dtype=np.float32) / (n - 1), atol=EPSILON))


def confusion_counts(
    y_true: Any,
    y_pred: Any,
    thresholds: Sequence[float],
    *,
    evenly: bool = False,
    sample_weight: Any = None,
    top_k: int | None = None,
    class_id: int | None = None,
    multi_label: bool = False,
    label_weights: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    what: str = "metric",
) -> dict[str, torch.Tensor]:
    """The float64 counts ``tp``, ``fp``, ``tn``, ``fn`` of a batch at each threshold, as Keras's
    ``update_confusion_matrix_variables`` counts them: a prediction is positive when it is
    strictly above the threshold; shape ``[T]`` (``[T, labels]`` with ``multi_label``)."""
    yp = _tensor(y_pred)
    yt = _tensor(y_true).to(device=yp.device)
    if not yp.is_floating_point() or yp.dtype != dtype:
        yp = yp.to(dtype)
    yt = yt.to(dtype)
    yp, yt = _same_rank(yp, yt)
    if yt.shape != yp.shape:
        raise ValueError(
            f"{what}: y_true has shape {tuple(yt.shape)} but y_pred has shape {tuple(yp.shape)}; they must "
            "match (up to a trailing axis of size 1)"
        )
    sw = None
    if sample_weight is not None:
        sw = _tensor(sample_weight).to(device=yp.device, dtype=dtype).unsqueeze(-1)
        _, sw = _same_rank(yt, sw, expand_rank_1=False)
    if top_k is not None:
        yp = _filter_top_k(yp, top_k)
    if class_id is not None:
        if yp.dim() == 1:
            raise ValueError(
                f"{what}: when class_id is provided, y_pred must be a 2D array with shape (num_samples, "
                f"num_classes), found shape: {tuple(yp.shape)}"
            )
        yt, yp = yt[..., class_id, None], yp[..., class_id, None]
    if multi_label and yp.dim() != 2:
        raise ValueError(f"{what}: multi_label=True needs y_pred of rank 2 (examples, labels); got {tuple(yp.shape)}")
    weights: torch.Tensor | None = None
    if sw is not None:
        weights = _broadcast(sw, yp.shape, what).to(torch.float64)
    if label_weights is not None and not multi_label:
        lw = torch.broadcast_to(label_weights.to(yp.device, torch.float64).unsqueeze(0), yp.shape)
        weights = lw if weights is None else weights * lw
    positive = yt != 0
    if not multi_label:
        yp, positive = yp.reshape(-1), positive.reshape(-1)
        weights = None if weights is None else weights.reshape(-1)
    w = torch.ones(yp.shape, dtype=torch.float64, device=yp.device) if weights is None else weights
    true_w = torch.where(positive, w, 0.0)
    false_w = torch.where(positive, 0.0, w)
    n = len(thresholds)
    if evenly:
        with_epsilon = thresholds[0] < 0.0 or thresholds[-1] > 1.0
        # Keras's buckets, computed in the metric's dtype: a prediction p counts at the thresholds
        # below bucket ceil(p * (n - 1)) - 1 (clipped to [0, 1]; the first bucket when the
        # thresholds have Keras's epsilon end points)
        bucket = torch.ceil(yp.clamp(0.0, 1.0) * float(n - 1)) - 1
        if with_epsilon:
            bucket = torch.relu(bucket)
        index = bucket.to(torch.int64)
        index = torch.where((index >= 0) & (index < n), index, n)  # out of range: a dropped bucket
        shape = (n + 1, *yp.shape[1:])
        tp_b = torch.zeros(shape, dtype=torch.float64, device=yp.device).scatter_add_(0, index, true_w)[:-1]
        fp_b = torch.zeros(shape, dtype=torch.float64, device=yp.device).scatter_add_(0, index, false_w)[:-1]
        tp = tp_b.flip(0).cumsum(0).flip(0)
        fp = fp_b.flip(0).cumsum(0).flip(0)
    else:
        thr = torch.tensor(list(thresholds), dtype=dtype, device=yp.device).reshape(n, *([1] * yp.dim()))
        above = yp.unsqueeze(0) > thr  # [T, examples(, labels)]
        tp = torch.where(above, true_w, 0.0).sum(1)
        fp = torch.where(above, false_w, 0.0).sum(1)
    total_true, total_false = true_w.sum(0), false_w.sum(0)
    return {"tp": tp, "fp": fp, "tn": total_false - fp, "fn": total_true - tp}


def _divide_no_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b == 0, torch.zeros_like(a), a / torch.where(b == 0, torch.ones_like(b), b))


def _parse_thresholds(thresholds: Any, default: float) -> list[float]:
    values = [default] if thresholds is None else (
        [float(t) for t in thresholds] if isinstance(thresholds, (list, tuple, np.ndarray)) else [float(thresholds)])
    if thresholds is not None:
        bad = [t for t in values if t is None or t < 0 or t > 1]
        if bad:
            raise ValueError(f"Threshold values must be in [0, 1]. Received: {bad}")
    return values


class _Counts(Metric):
    """A metric whose state is named arrays of float64 counts (the totals, flattened in order);
    shapes known at construction or, like Keras's lazily built metrics, at the first batch."""

    additive = True  # counts of a batch are the sums of its examples' counts

    def __init__(self, name: str | None = None, dtype: Any = None) -> None:
        self.num_totals = 0
        super().__init__(name, dtype)
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def _build(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self._shapes = dict(shapes)
        self.num_totals = sum(math.prod(s) for s in shapes.values())
        self._totals = torch.zeros(self.num_totals, dtype=torch.float64)

    def _pack(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        assert self._shapes is not None
        return torch.cat([parts[k].to(torch.float64).reshape(-1) for k in self._shapes])

    def _unpack(self, totals: torch.Tensor) -> dict[str, torch.Tensor]:
        assert self._shapes is not None
        out, offset = {}, 0
        for k, shape in self._shapes.items():
            size = math.prod(shape)
            out[k] = totals[offset : offset + size].reshape(shape)
            offset += size
        return out

    def _shapes_for(self, num_totals: int) -> dict[str, tuple[int, ...]]:
        """The state's shapes from its size (a lazily built metric resumed from saved totals)."""
        raise ValueError(f"{self.name}: cannot rebuild the state from {num_totals} totals")

    def compute(self, totals: torch.Tensor) -> torch.Tensor:
        if self._shapes is None:  # never updated
            return torch.zeros((), dtype=torch.float64)
        return self._result(self._unpack(totals.to(torch.float64)))

    def _result(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def load_totals(self, totals: torch.Tensor) -> None:
        if self._shapes is None:
            self._build(self._shapes_for(int(totals.numel())))
        super().load_totals(totals)

    @property
    def variables(self) -> list[torch.Tensor]:  # type: ignore[override]
        """The state as Keras names its variables (``true_positives``, ...), this replica's."""
        if self._shapes is None:
            return []
        return list(self._unpack(self.local_totals()).values())


class _ThresholdCounts(_Counts):
    """Keras's ``_ConfusionMatrixConditionCount``: one count per threshold."""

    _key = "tp"

    def __init__(self, thresholds: Any = None, name: str | None = None, dtype: Any = None) -> None:
        super().__init__(name, dtype)
        self.init_thresholds = thresholds
        self.thresholds = _parse_thresholds(thresholds, 0.5)
        self._evenly = is_evenly_distributed(self.thresholds)
        self._build({self._key: (len(self.thresholds),)})

    def batch_totals(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        counts = confusion_counts(y_true, y_pred, self.thresholds, evenly=self._evenly, sample_weight=sample_weight,
                                  dtype=self.dtype, what=type(self).__name__)
        return self._pack(counts)

    def _result(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        v = state[self._key]
        return v[0].clone() if len(self.thresholds) == 1 else v.clone()

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "thresholds": self.init_thresholds}


class TruePositives(_ThresholdCounts):
    """The (weighted) count of positives predicted positive (``y_pred > threshold``)."""

    default_name = "true_positives"
    _key = "tp"


class FalsePositives(_ThresholdCounts):
    """The (weighted) count of negatives predicted positive."""

    default_name = "false_positives"
    _key = "fp"


class TrueNegatives(_ThresholdCounts):
    """The (weighted) count of negatives predicted negative."""

    default_name = "true_negatives"
    _key = "tn"


class FalseNegatives(_ThresholdCounts):
    """The (weighted) count of positives predicted negative."""

    default_name = "false_negatives"
    _key = "fn"


class _PrecisionRecall(_Counts):
    _keys: tuple[str, str] = ("tp", "fp")

    def __init__(self, thresholds: Any = None, top_k: int | None = None, class_id: int | None = None,
                 name: str | None = None, dtype: Any = None) -> None:
        super().__init__(name, dtype)
        self.init_thresholds = thresholds
        self.top_k = top_k
        self.class_id = class_id
        self.thresholds = _parse_thresholds(thresholds, 0.5 if top_k is None else NEG_INF)
        self._evenly = is_evenly_distributed(self.thresholds)
        n = len(self.thresholds)
        self._build({k: (n,) for k in self._keys})

    def batch_totals(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        counts = confusion_counts(y_true, y_pred, self.thresholds, evenly=self._evenly, sample_weight=sample_weight,
                                  top_k=self.top_k, class_id=self.class_id, dtype=self.dtype, what=type(self).__name__)
        return self._pack(counts)

    def _result(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        a, b = (state[k] for k in self._keys)
        v = _divide_no_nan(state["tp"], a + b)
        return v[0] if len(self.thresholds) == 1 else v

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "thresholds": self.init_thresholds, "top_k": self.top_k, "class_id": self.class_id}


class Precision(_PrecisionRecall):
    """Keras's Precision: ``tp / (tp + fp)`` of the counts over every example seen, at each
    threshold (0.5 by default; ``top_k``: only the k highest predictions can be positive;
    ``class_id``: one class's column)."""

    default_name = "precision"
    _keys = ("tp", "fp")


class Recall(_PrecisionRecall):
    """Keras's Recall: ``tp / (tp + fn)`` of the counts over every example seen (arguments as
    ``Precision``)."""

    default_name = "recall"
    _keys = ("tp", "fn")


class AUC(_Counts):
    """Keras's AUC: the area under the ROC (or PR, or PR-gain) curve from confusion counts at
    ``num_thresholds`` thresholds (Keras's placement: ``i / (num_thresholds - 1)`` inside (0, 1)
    and ``-1e-7``, ``1 + 1e-7`` at the ends), Riemann sum by ``summation_method``
    ("interpolation", Keras's default: the trapezoid for ROC, Davis & Goadrich's interpolation
    for PR; "minoring"; "majoring"). ``multi_label``: one curve per label (the state is
    ``[num_thresholds, labels]``), averaged (by ``label_weights`` when given)."""

    default_name = "auc"

    def __init__(
        self, num_thresholds: int = 200, curve: str = "ROC", summation_method: str = "interpolation",
        name: str | None = None, dtype: Any = None, thresholds: Sequence[float] | None = None,
        multi_label: bool = False, num_labels: int | None = None, label_weights: Any = None,
        from_logits: bool = False,
    ) -> None:
        curves = {"roc": "ROC", "pr": "PR", "prgain": "PRGAIN"}
        if str(curve).lower() not in curves or str(curve) not in (curves[str(curve).lower()], str(curve).lower()):
            raise ValueError(f'Invalid AUC curve value: "{curve}". Expected values are ["PR", "ROC", "PRGAIN"]')
        methods = ("interpolation", "majoring", "minoring")
        if str(summation_method).lower() not in methods or str(summation_method) not in (
                summation_method.lower(), summation_method.lower().capitalize()):
            raise ValueError(f'Invalid AUC summation method value: "{summation_method}". Expected values are '
                             '["interpolation", "majoring", "minoring"]')
        super().__init__(name, dtype)
        self._init_from_thresholds = thresholds is not None
        if thresholds is not None:
            inner = sorted(float(t) for t in thresholds)
            self.num_thresholds = len(inner) + 2
            self._evenly = is_evenly_distributed([0.0, *inner, 1.0])
        else:
            if num_thresholds <= 1:
                raise ValueError(f"Argument `num_thresholds` must be an integer > 1. Received: num_thresholds={num_thresholds}")
            self.num_thresholds = num_thresholds
            inner = [(i + 1) * 1.0 / (num_thresholds - 1) for i in range(num_thresholds - 2)]
            self._evenly = True
        self._thresholds = [0.0 - EPSILON, *inner, 1.0 + EPSILON]
        self.curve = curves[str(curve).lower()]
        self.summation_method = str(summation_method).lower()
        self.multi_label = multi_label
        self.num_labels = num_labels
        self.label_weights = None if label_weights is None else torch.as_tensor(label_weights, dtype=torch.float64)
        self._from_logits = from_logits
        if multi_label:
            if num_labels:
                self._build_labels(num_labels)
        else:
            if num_labels:
                raise ValueError("`num_labels` is needed only when `multi_label` is True.")
            self._build_labels(None)

    @property
    def thresholds(self) -> list[float]:
        """The thresholds used for evaluating AUC (with Keras's epsilon end points)."""
        return list(self._thresholds)

    def _build_labels(self, labels: int | None) -> None:
        shape = (self.num_thresholds,) if labels is None else (self.num_thresholds, labels)
        self._build({"tp": shape, "fp": shape, "tn": shape, "fn": shape})

    def _shapes_for(self, num_totals: int) -> dict[str, tuple[int, ...]]:
        labels = num_totals // (4 * self.num_thresholds)
        shape = (self.num_thresholds, labels)
        return {"tp": shape, "fp": shape, "tn": shape, "fn": shape}

    def batch_totals(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        yp = _tensor(y_pred)
        if self._shapes is None:
            if yp.dim() != 2:
                raise ValueError(
                    f"`y_pred` must have rank 2 when `multi_label=True`. Found rank {yp.dim()}. Full shape received "
                    f"for `y_pred`: {tuple(yp.shape)}")
            self._build_labels(int(yp.shape[1]))
        if self._from_logits:
            yp = torch.sigmoid(yp.to(self.dtype))
        counts = confusion_counts(
            y_true, yp, self._thresholds, evenly=self._evenly, sample_weight=sample_weight,
            multi_label=self.multi_label, label_weights=None if self.multi_label else self.label_weights,
            dtype=self.dtype, what="AUC")
        return self._pack(counts)

    def _average(self, by_label: torch.Tensor) -> torch.Tensor:
        if not self.multi_label:
            return by_label
        if self.label_weights is None:
            return by_label.mean()
        lw = self.label_weights.to(by_label.device)
        return _divide_no_nan((by_label * lw).sum(), lw.sum())

    def _result(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        tp, fp, tn, fn = state["tp"], state["fp"], state["tn"], state["fn"]
        n = self.num_thresholds
        if self.curve == "PR" and self.summation_method == "interpolation":
            dtp = tp[: n - 1] - tp[1:]
            p = tp + fp
            dp = p[: n - 1] - p[1:]
            slope = _divide_no_nan(dtp, dp.clamp_min(0))
            intercept = tp[1:] - slope * p[1:]
            ratio = torch.where((p[: n - 1] > 0) & (p[1:] > 0), _divide_no_nan(p[: n - 1], p[1:].clamp_min(0)),
                                torch.ones_like(p[1:]))
            increments = _divide_no_nan(slope * (dtp + intercept * torch.log(ratio)), (tp[1:] + fn[1:]).clamp_min(0))
            return self._average(increments.sum(0))
        recall = _divide_no_nan(tp, tp + fn)
        if self.curve == "ROC":
            x, y = _divide_no_nan(fp, fp + tn), recall
        elif self.curve == "PR":
            x, y = recall, _divide_no_nan(tp, tp + fp)
        else:  # PRGAIN
            scale = _divide_no_nan(tp + fn, tn + fp)
            recall_gain = 1.0 - scale * _divide_no_nan(fn, tp)
            precision_gain = 1.0 - scale * _divide_no_nan(fp, tp)
            recall_gain = torch.where(tp == 0, 0.0, recall_gain).clamp_min(0.0)
            precision_gain = torch.where(tp == 0, 1.0, precision_gain)
            x, y = recall_gain, precision_gain
        if self.summation_method == "interpolation":
            heights = (y[: n - 1] + y[1:]) / 2.0
        elif self.summation_method == "minoring":
            heights = torch.minimum(y[: n - 1], y[1:])
        else:
            heights = torch.maximum(y[: n - 1], y[1:])
        return self._average(((x[: n - 1] - x[1:]) * heights).sum(0))

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "name": self.name, "num_thresholds": self.num_thresholds, "curve": self.curve,
            "summation_method": self.summation_method, "multi_label": self.multi_label,
            "num_labels": self.num_labels,
            "label_weights": None if self.label_weights is None else self.label_weights.tolist(),
            "from_logits": self._from_logits,
        }
        if self._init_from_thresholds:
            config["thresholds"] = self._thresholds[1:-1]
        return config


class FBetaScore(_Counts):
    """Keras's FBetaScore: ``(1 + beta^2) * precision * recall / (beta^2 * precision + recall)``
    per class from the counts over every example seen (``threshold=None``: the highest
    prediction of each example is its positive), averaged by ``average`` (None: one score per
    class; "micro": from the counts of every class together; "macro"; "weighted": by support).
    Labels and predictions are ``(examples, classes)``."""

    default_name = "fbeta_score"

    def __init__(self, average: str | None = None, beta: float = 1.0, threshold: float | None = None,
                 name: str | None = None, dtype: Any = None) -> None:
        if average not in (None, "micro", "macro", "weighted"):
            raise ValueError("Invalid `average` argument value. Expected one of: {None, 'micro', 'macro', "
                             f"'weighted'}}. Received: average={average}")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0.0:
            raise ValueError(f"Invalid `beta` argument value. It should be a number > 0. Received: beta={beta!r}")
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or threshold > 1.0 or threshold <= 0.0):
            raise ValueError(f"Invalid `threshold` argument value. It should verify 0 < threshold <= 1. "
                             f"Received: threshold={threshold!r}")
        super().__init__(name, dtype)
        self.average = average
        self.beta = float(beta)
        self.threshold = None if threshold is None else float(threshold)
        if average == "micro":
            self._build({k: () for k in ("tp", "fp", "fn", "weights")})

    def _shapes_for(self, num_totals: int) -> dict[str, tuple[int, ...]]:
        return {k: (num_totals // 4,) for k in ("tp", "fp", "fn", "weights")}

    def batch_totals(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        yp = _tensor(y_pred)
        yt = _tensor(y_true).to(yp.device)
        if yp.dim() != 2 or yt.dim() != 2:
            raise ValueError(
                f"{type(self).__name__} expects 2D inputs with shape (batch_size, output_dim). Received input "
                f"shapes: y_pred.shape={tuple(yp.shape)} and y_true.shape={tuple(yt.shape)}.")
        if self._shapes is None:
            self._build({k: (int(yp.shape[-1]),) for k in ("tp", "fp", "fn", "weights")})
        yp = yp.to(self.dtype)
        if self.threshold is None:
            predicted = (yp >= yp.max(dim=-1, keepdim=True).values) & (yp.abs() > 1e-9)
        else:
            predicted = yp > self.threshold
        p = predicted.to(torch.float64)
        t = yt.to(self.dtype).to(torch.float64)
        axis: Any = None if self.average == "micro" else 0
        w = None
        if sample_weight is not None:
            w = _tensor(sample_weight).to(yp.device, torch.float64)
            if w.dim() == 2 and w.shape[1] == 1:
                w = w[:, 0]
            if w.dim() > 1 or (w.dim() == 1 and w.shape[0] != yp.shape[0]):
                raise ValueError(
                    f"{type(self).__name__}: sample_weight of shape {tuple(w.shape)} for {yp.shape[0]} examples; "
                    "give one weight per example")
            w = w.reshape(-1, 1) if w.dim() == 1 else w

        def total(v: torch.Tensor) -> torch.Tensor:
            if w is not None:
                v = v * w
            return v.sum() if axis is None else v.sum(axis)

        return self._pack({"tp": total(p * t), "fp": total(p * (1 - t)), "fn": total((1 - p) * t),
                           "weights": total(t)})

    def _result(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        tp, fp, fn = state["tp"], state["fp"], state["fn"]
        precision = tp / (tp + fp + EPSILON)
        recall = tp / (tp + fn + EPSILON)
        b2 = self.beta**2
        f = precision * recall / (b2 * precision + recall + EPSILON) * (1 + b2)
        if self.average == "weighted":
            weights = state["weights"] / (state["weights"].sum() + EPSILON)
            return (f * weights).sum()
        if self.average is not None:
            return f.mean()
        return f

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "average": self.average, "beta": self.beta, "threshold": self.threshold}


class F1Score(FBetaScore):
    """Keras's F1Score: ``FBetaScore`` with ``beta=1``."""

    default_name = "f1_score"

    def __init__(self, average: str | None = None, threshold: float | None = None, name: str | None = None,
                 dtype: Any = None) -> None:
        super().__init__(average=average, beta=1.0, threshold=threshold, name=name, dtype=dtype)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        del config["beta"]
        return config


class IoU(_Counts):
    """Keras's IoU: ``tp / (tp + fp + fn)`` per class from the confusion matrix of every example
    seen, averaged over ``target_class_ids`` (classes never seen left out). Labels and
    predictions are class ids (``sparse_y_true`` / ``sparse_y_pred``; else the argmax of
    ``axis``); ids out of range, and ``ignore_class``, count for nothing. As in Keras the
    default dtype is "int": ids and sample weights are truncated to integers."""

    default_name = "io_u"

    def __init__(self, num_classes: int, target_class_ids: Sequence[int], name: str | None = None, dtype: Any = None,
                 ignore_class: int | None = None, sparse_y_true: bool = True, sparse_y_pred: bool = True,
                 axis: int = -1) -> None:
        super().__init__(name, "int" if dtype is None else dtype)
        if max(target_class_ids) >= num_classes:
            raise ValueError(f"Target class id {max(target_class_ids)} is out of range, which is [0, {num_classes}).")
        self.num_classes = num_classes
        self.target_class_ids = list(target_class_ids)
        self.ignore_class = ignore_class
        self.sparse_y_true = sparse_y_true
        self.sparse_y_pred = sparse_y_pred
        self.axis = axis
        self._build({"total_confusion_matrix": (num_classes, num_classes)})

    def batch_totals(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        yp = _tensor(y_pred)
        yt = _tensor(y_true).to(yp.device)
        if not self.sparse_y_true:
            yt = yt.argmax(dim=self.axis)
        if not self.sparse_y_pred:
            yp = yp.argmax(dim=self.axis)
        yt, yp = yt.to(self.dtype).reshape(-1).to(torch.int64), yp.to(self.dtype).reshape(-1).to(torch.int64)
        if yt.shape != yp.shape:
            raise ValueError(f"{type(self).__name__}: {yt.numel()} labels but {yp.numel()} predictions")
        integer = not self.dtype.is_floating_point
        if sample_weight is None:
            w = torch.ones(yt.shape, dtype=torch.float64, device=yt.device)
        else:
            sw = _tensor(sample_weight).to(yt.device)
            if integer and sw.is_floating_point():
                warnings.warn("You are passing weight as `float`, but dtype is `int`. This may result in an incorrect "
                              "weight due to type casting Consider using integer weights.", stacklevel=2)
            sw = sw.to(self.dtype).reshape(-1) if sw.dim() > 1 else sw.to(self.dtype)
            w = _broadcast(sw, yt.shape, type(self).__name__).to(torch.float64)
        keep = (yt >= 0) & (yt < self.num_classes) & (yp >= 0) & (yp < self.num_classes)
        if self.ignore_class is not None:
            keep &= yt != self.ignore_class
        w = torch.where(keep, w, 0.0)
        cell = torch.where(keep, yt * self.num_classes + yp, 0)
        cm = torch.zeros(self.num_classes**2, dtype=torch.float64, device=yt.device).index_add_(0, cell, w)
        return cm

    def _result(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        cm = state["total_confusion_matrix"]
        tp = cm.diagonal()
        denominator = cm.sum(0) + cm.sum(1) - tp
        ids = torch.tensor(self.target_class_ids, dtype=torch.int64)
        tp, denominator = tp[ids], denominator[ids]
        valid = denominator > 1e-9
        iou = torch.where(valid, tp / (denominator + EPSILON), 0.0)
        return iou.sum() / (valid.sum().to(torch.float64) + EPSILON)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "num_classes": self.num_classes, "target_class_ids": self.target_class_ids,
                "ignore_class": self.ignore_class, "sparse_y_true": self.sparse_y_true,
                "sparse_y_pred": self.sparse_y_pred, "axis": self.axis}


class MeanIoU(IoU):
    """Keras's MeanIoU: ``IoU`` over every class."""

    default_name = "mean_io_u"

    def __init__(self, num_classes: int, name: str | None = None, dtype: Any = None, ignore_class: int | None = None,
                 sparse_y_true: bool = True, sparse_y_pred: bool = True, axis: int = -1) -> None:
        super().__init__(num_classes, list(range(num_classes)), name=name, dtype=dtype, ignore_class=ignore_class,
                         sparse_y_true=sparse_y_true, sparse_y_pred=sparse_y_pred, axis=axis)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        del config["target_class_ids"]
        return config


class SparseTopKCategoricalAccuracy(_PerExample):
    """How often the integer label is among the ``k`` highest predictions (Keras's: a label
    whose prediction ties the k-th highest counts as in the top k; ``from_sorted_ids``: the
    predictions are class ids, best first)."""

    default_name = "sparse_top_k_categorical_accuracy"

    def __init__(self, k: int = 5, name: str | None = None, from_sorted_ids: bool = False) -> None:
        if k < 1:
            raise ValueError(f"SparseTopKCategoricalAccuracy needs k >= 1, got {k}")
        self.k = k
        self.from_sorted_ids = from_sorted_ids
        super().__init__(name)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "k": self.k, "from_sorted_ids": self.from_sorted_ids}

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        yt = y_true.squeeze(-1) if y_true.dim() == y_pred.dim() and y_true.shape[-1] == 1 else y_true
        if yt.shape != y_pred.shape[:-1]:
            raise ValueError(
                f"SparseTopKCategoricalAccuracy needs integer labels of shape {tuple(y_pred.shape[:-1])} for "
                f"predictions of shape {tuple(y_pred.shape)}; got labels of shape {tuple(y_true.shape)} (for "
                "one-hot labels use TopKCategoricalAccuracy)")
        if self.from_sorted_ids:
            hit = (y_pred[..., : self.k] == yt.unsqueeze(-1).to(y_pred.dtype)).any(dim=-1)
        else:
            hit = in_top_k(yt.long(), y_pred, self.k)
        return _per_example_mean(hit)


#: The names Keras 3's ``keras.metrics.get`` accepts for these metrics (its snake-case names
#: and class names), each logging under the name given, as Keras logs them.
BY_NAME: dict[str, type[Metric]] = {
    "auc": AUC,
    "AUC": AUC,
    "precision": Precision,
    "Precision": Precision,
    "recall": Recall,
    "Recall": Recall,
    "f1_score": F1Score,
    "F1Score": F1Score,
    "FBetaScore": FBetaScore,
    "true_positives": TruePositives,
    "TruePositives": TruePositives,
    "false_positives": FalsePositives,
    "FalsePositives": FalsePositives,
    "true_negatives": TrueNegatives,
    "TrueNegatives": TrueNegatives,
    "false_negatives": FalseNegatives,
    "FalseNegatives": FalseNegatives,
    "sparse_top_k_categorical_accuracy": SparseTopKCategoricalAccuracy,
    "SparseTopKCategoricalAccuracy": SparseTopKCategoricalAccuracy,
}
