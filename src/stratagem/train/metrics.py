"""Streaming metrics whose state is a vector of totals, summed exactly across replicas.

Every metric keeps float64 totals (a weighted sum of values and a total weight, or counts) for
the examples *this replica* saw. ``result()`` computes the value from the totals summed over all
replicas, never from a mean of per-replica means, so a partial last batch, a replica that got a
zero-size batch, or masked (zero-weight) padding count exactly as on one device.

Where the sum happens: inside ``strategy.run`` every replica must call ``result()`` (it
all-reduces, like tf.distribute's ``ReplicaContext.all_reduce``); inside a strategy's scope,
outside ``run``, it all-reduces through ``strategy.reduce``; outside any strategy it is local.
``sync_metrics(strategy, metrics)`` does the all-reduce for many metrics in one collective and
caches the global totals, so that afterwards ``result()`` needs no communication (``fit`` does
this, so a progress bar on replica 0 alone can read results without hanging the others).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from stratagem.distribute import current
from stratagem.distribute.strategy import Strategy

__all__ = [
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "KerasAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Metric",
    "SparseCategoricalAccuracy",
    "Sum",
    "TopKCategoricalAccuracy",
    "get",
    "sync_metrics",
]


def _tensor(x: Any) -> torch.Tensor:
    t = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    return t


def _weights(sample_weight: Any, batch: int, like: torch.Tensor) -> torch.Tensor:
    """Per-example float64 weights of shape [batch] (ones when ``sample_weight`` is None)."""
    if sample_weight is None:
        return torch.ones(batch, dtype=torch.float64, device=like.device)
    w = _tensor(sample_weight).to(device=like.device, dtype=torch.float64)
    if w.dim() == 0:
        return w.expand(batch)
    if w.shape[0] != batch:
        raise ValueError(
            f"sample_weight has shape {tuple(w.shape)} but the batch has {batch} examples; pass "
            "one weight (or mask value) per example"
        )
    return w.flatten(1).mean(dim=1) if w.dim() > 1 else w


class Metric(abc.ABC):
    """A streaming metric: ``update_state`` per batch, ``result`` for all replicas, ``reset_state``."""

    #: How many float64 totals the state holds.
    num_totals: int = 2
    #: The key under which ``fit`` logs the metric when no ``name`` is given.
    default_name: str = "metric"
    #: Whether a batch's totals are the sum of its examples' totals (true of every built-in
    #: metric), so that one update with several batches concatenated along the batch dimension
    #: gives the totals of one update per batch: ``fit`` then updates it once per execution.
    additive: bool = False

    def __init__(self, name: str | None = None) -> None:
        self.name = name if name is not None else self.default_name
        self._totals = torch.zeros(self.num_totals, dtype=torch.float64)
        self._pending: torch.Tensor | None = None  # totals added on the batch's device, not read yet
        self._global: torch.Tensor | None = None
        self._strategy: Strategy | None = None  # the strategy the last update ran under

    def get_config(self) -> dict[str, Any]:
        """Keras's ``get_config``: the arguments that make this metric again (``cls(**config)``)."""
        return {"name": self.name}

    def __getstate__(self) -> dict[str, Any]:
        """A metric shipped elsewhere (a function a parameter-server worker runs) leaves behind
        the strategy it was last updated under (it is that process's business)."""
        state = dict(self.__dict__)
        state["_strategy"] = None
        return state

    # --- the per-metric parts --------------------------------------------------------------
    @abc.abstractmethod
    def batch_totals(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The float64 totals one batch contributes (same arguments as ``update_state``)."""

    def compute(self, totals: torch.Tensor) -> torch.Tensor:
        """The value from (global) totals; default: weighted sum / total weight (0 when empty)."""
        return totals[0] / totals[1] if float(totals[1]) != 0 else torch.zeros((), dtype=torch.float64)

    # --- the streaming API ------------------------------------------------------------------
    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Add one batch (this replica's slice of it) to the totals.

        The totals stay on the batch's device (no host read-back per step); they are read when
        a result or a sync needs them."""
        self.add_totals(self.batch_totals(*args, **kwargs))

    def add_totals(self, totals: torch.Tensor) -> None:
        """Add totals computed elsewhere (``batch_totals``'s form) to this replica's totals."""
        t = totals.detach()
        if t.dtype != torch.float64:
            t = t.to(torch.float64)
        if self._pending is None or self._pending.device != t.device:
            self._fold()
            self._pending = t.clone()
        else:
            self._pending += t
        self._global = None
        strategy = current.get_strategy()
        if strategy.num_replicas_in_sync > 1 or self._strategy is None:
            self._strategy = strategy

    def _fold(self) -> None:
        if self._pending is not None:
            self._totals += self._pending.to("cpu")
            self._pending = None

    def result(self) -> torch.Tensor:
        """The metric over every example every replica has seen since the last reset.

        Under a strategy with several replicas this is a collective (every replica calls it),
        also outside the scope: the totals are summed across the replicas of the strategy the
        updates ran under, never this replica's alone."""
        if self._global is not None:
            return self.compute(self._global)
        self._fold()
        return self.compute(_sum_across_replicas(self._totals, self._strategy))

    def reset_state(self) -> None:
        """Forget every example seen (on this replica; call it on every replica)."""
        self._totals.zero_()
        self._pending = None
        self._global = None

    def global_totals(self) -> torch.Tensor:
        """The totals cached by the last ``sync_metrics`` (this replica's if none since an update)."""
        self._fold()
        return (self._global if self._global is not None else self._totals).clone()

    def local_totals(self) -> torch.Tensor:
        """This replica's totals (a copy)."""
        self._fold()
        return self._totals.clone()

    def set_global_totals(self, totals: torch.Tensor) -> None:
        """Cache the totals summed across replicas (what ``sync_metrics`` computes)."""
        if totals.shape != self._totals.shape:
            raise ValueError(f"{self.name}: expected {self.num_totals} totals, got shape {tuple(totals.shape)}")
        self._global = totals.detach().to("cpu", torch.float64).clone()

    def load_totals(self, totals: torch.Tensor) -> None:
        """Replace this replica's totals (used to resume a metric from a checkpoint)."""
        self._totals = totals.detach().to("cpu", torch.float64).clone().reshape(self.num_totals)
        self._pending = None
        self._global = None

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``update_state`` then ``result`` (so every replica must call it under a strategy)."""
        self.update_state(*args, **kwargs)
        return self.result()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _sum_across_replicas(totals: torch.Tensor, updated_under: Strategy | None) -> torch.Tensor:
    ctx = current.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        return ctx.all_reduce("sum", totals)  # type: ignore[no-any-return]
    if ctx is None:  # cross-replica context: the open scope's strategy
        return current.get_strategy().reduce("sum", totals)  # type: ignore[no-any-return]
    if updated_under is not None and updated_under.num_replicas_in_sync > 1:
        return updated_under.reduce("sum", totals).to("cpu", torch.float64)  # outside any scope
    return totals


def sync_metrics(strategy: Strategy, metrics: Sequence[Metric], extra: Sequence[float] = ()) -> list[float]:
    """Sum the totals of ``metrics`` (and the numbers ``extra``) across replicas in one
    collective; cache the metrics' totals in each and return the summed ``extra``.

    Every replica must call it with the same metrics in the same order.
    """
    if not metrics and not extra:
        return []
    flat = torch.cat([*(m.local_totals() for m in metrics), torch.tensor(list(extra), dtype=torch.float64)])
    if strategy.num_replicas_in_sync > 1:
        flat = strategy.reduce("sum", flat).to("cpu", torch.float64)
    offset = 0
    for m in metrics:
        m.set_global_totals(flat[offset : offset + m.num_totals])
        offset += m.num_totals
    return flat[offset:].tolist()


# --- concrete metrics ------------------------------------------------------------------------


class Mean(Metric):
    """The (weighted) mean of the values given: sum(w * v) / sum(w)."""

    default_name = "mean"
    additive = True

    def batch_totals(self, values: Any, sample_weight: Any = None) -> torch.Tensor:
        v = _tensor(values).to(torch.float64)
        if v.dim() == 0:
            v = v.reshape(1)
        v = v.flatten(1).mean(dim=1) if v.dim() > 1 else v
        if sample_weight is None:  # the common case, in two device ops and no host sync
            total = v.sum()
            return torch.stack((total, total.new_full((), float(v.shape[0]))))
        w = _weights(sample_weight, v.shape[0], v)
        return torch.stack([(v * w).sum(), w.sum()])


class Sum(Metric):
    """The (weighted) sum of the values given."""

    default_name = "sum"
    additive = True
    num_totals = 1

    def batch_totals(self, values: Any, sample_weight: Any = None) -> torch.Tensor:
        v = _tensor(values).to(torch.float64)
        if sample_weight is None:
            return v.sum().reshape(1)
        v = v.reshape(1) if v.dim() == 0 else v
        v = v.flatten(1).sum(dim=1) if v.dim() > 1 else v
        return (v * _weights(sample_weight, v.shape[0], v)).sum().reshape(1)

    def compute(self, totals: torch.Tensor) -> torch.Tensor:
        return totals[0].clone()


class _PerExample(Metric):
    """A metric that is the weighted mean of a per-example score of (y_true, y_pred)."""
    additive = True

    @abc.abstractmethod
    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        """One float64 score per example (shape [batch])."""

    def batch_totals(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        yt, yp = _tensor(y_true), _tensor(y_pred)
        if yp.dim() == 0 or yt.dim() == 0:
            raise ValueError(
                f"{type(self).__name__} needs batched y_true and y_pred; got shapes "
                f"{tuple(yt.shape)} and {tuple(yp.shape)}"
            )
        if yt.shape[0] != yp.shape[0]:
            raise ValueError(
                f"{type(self).__name__}: y_true has {yt.shape[0]} examples but y_pred has "
                f"{yp.shape[0]}; pass the labels and predictions of the same batch"
            )
        scores = self.per_example(yt, yp.to(yt.device)).to(torch.float64)
        if sample_weight is None:
            total = scores.sum()
            return torch.stack((total, total.new_full((), float(scores.shape[0]))))
        w = _weights(sample_weight, scores.shape[0], scores)
        return torch.stack([(scores * w).sum(), w.sum()])


def _squeeze_like(y_true: torch.Tensor, y_pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop a trailing size-1 axis so [B] labels compare with [B, 1] predictions (as Keras does)."""
    if y_pred.dim() == y_true.dim() + 1 and y_pred.shape[-1] == 1:
        y_pred = y_pred.squeeze(-1)
    elif y_true.dim() == y_pred.dim() + 1 and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    if y_true.shape != y_pred.shape:
        raise ValueError(
            f"y_true has shape {tuple(y_true.shape)} but y_pred has shape {tuple(y_pred.shape)}; "
            "they must match (up to a trailing axis of size 1)"
        )
    return y_true, y_pred


def _per_example_mean(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float64)
    return x.flatten(1).mean(dim=1) if x.dim() > 1 else x


class Accuracy(_PerExample):
    """How often predictions equal labels exactly (for class ids or already-rounded outputs)."""

    default_name = "accuracy"

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        yt, yp = _squeeze_like(y_true, y_pred)
        return _per_example_mean(yt == yp)


class SparseCategoricalAccuracy(_PerExample):
    """How often ``argmax(y_pred, -1)`` equals the integer label ``y_true``."""

    default_name = "sparse_categorical_accuracy"

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        yt = y_true.squeeze(-1) if y_true.dim() == y_pred.dim() and y_true.shape[-1] == 1 else y_true
        if yt.shape != y_pred.shape[:-1]:
            raise ValueError(
                f"SparseCategoricalAccuracy needs integer labels of shape {tuple(y_pred.shape[:-1])} "
                f"for predictions of shape {tuple(y_pred.shape)}; got labels of shape "
                f"{tuple(y_true.shape)} (for one-hot labels use TopKCategoricalAccuracy(k=1))"
            )
        return _per_example_mean(y_pred.argmax(dim=-1) == yt.long())


class TopKCategoricalAccuracy(_PerExample):
    """How often the label is among the ``k`` highest predictions (one-hot or integer labels)."""

    default_name = "top_k_categorical_accuracy"

    def __init__(self, k: int = 5, name: str | None = None) -> None:
        if k < 1:
            raise ValueError(f"TopKCategoricalAccuracy needs k >= 1, got {k}")
        self.k = k
        super().__init__(name)

    def get_config(self) -> dict[str, Any]:
        return {"k": self.k, "name": self.name}

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if y_true.shape == y_pred.shape:  # one-hot (or probability) labels
            labels = y_true.argmax(dim=-1)
        elif y_true.shape == y_pred.shape[:-1]:
            labels = y_true.long()
        else:
            raise ValueError(
                f"TopKCategoricalAccuracy needs one-hot labels of shape {tuple(y_pred.shape)} or "
                f"integer labels of shape {tuple(y_pred.shape[:-1])}; got {tuple(y_true.shape)}"
            )
        k = min(self.k, y_pred.shape[-1])
        top = y_pred.topk(k, dim=-1).indices
        return _per_example_mean((top == labels.unsqueeze(-1)).any(dim=-1))


class MeanSquaredError(_PerExample):
    """Mean over examples of the mean squared error over each example's values."""

    default_name = "mean_squared_error"

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        yt, yp = _squeeze_like(y_true, y_pred)
        return _per_example_mean((yp.to(torch.float64) - yt.to(torch.float64)) ** 2)


class MeanAbsoluteError(_PerExample):
    """Mean over examples of the mean absolute error over each example's values."""

    default_name = "mean_absolute_error"

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        yt, yp = _squeeze_like(y_true, y_pred)
        return _per_example_mean((yp.to(torch.float64) - yt.to(torch.float64)).abs())


class BinaryAccuracy(_PerExample):
    """How often ``y_pred > threshold`` equals the 0/1 label (Keras's binary_accuracy)."""

    default_name = "binary_accuracy"

    def __init__(self, threshold: float = 0.5, name: str | None = None) -> None:
        self.threshold = threshold
        super().__init__(name)

    def get_config(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "name": self.name}

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        yt, yp = _squeeze_like(y_true, y_pred)
        return _per_example_mean((yp > self.threshold).to(yt.dtype) == yt)


class CategoricalAccuracy(_PerExample):
    """How often ``argmax(y_pred)`` equals ``argmax(y_true)`` (one-hot labels)."""

    default_name = "categorical_accuracy"

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return _per_example_mean(y_pred.argmax(dim=-1) == y_true.argmax(dim=-1))


class KerasAccuracy(_PerExample):
    """``"accuracy"`` as Keras reads it, chosen by the shapes of each batch: predictions with one
    value per example (or a trailing 1) are binary (``> 0.5``); one-hot labels shaped like the
    predictions are categorical; integer labels are sparse categorical."""

    default_name = "accuracy"

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if y_pred.dim() < 2 or y_pred.shape[-1] == 1:
            return BinaryAccuracy.per_example(BinaryAccuracy(), y_true, y_pred)
        if y_true.shape == y_pred.shape:
            return CategoricalAccuracy.per_example(CategoricalAccuracy(), y_true, y_pred)
        return SparseCategoricalAccuracy.per_example(SparseCategoricalAccuracy(), y_true, y_pred)


_BY_NAME: dict[str, type[Metric]] = {
    "accuracy": KerasAccuracy,
    "acc": KerasAccuracy,
    "exact_accuracy": Accuracy,
    "binary_accuracy": BinaryAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "top_k_categorical_accuracy": TopKCategoricalAccuracy,
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
}


def get(metric: Metric | str) -> Metric:
    """A metric object from a metric or its name (``"sparse_categorical_accuracy"``, ``"mse"``)."""
    if isinstance(metric, Metric):
        return metric
    if isinstance(metric, str) and metric.lower() in _BY_NAME:
        return _BY_NAME[metric.lower()]()
    raise ValueError(
        f"unknown metric {metric!r}; pass a stratagem.metrics.Metric or one of "
        f"{sorted(_BY_NAME)}"
    )


def get_all(metrics: Iterable[Metric | str]) -> list[Metric]:
    """Metric objects for ``metrics``; a clear error when two would log under the same name."""
    out = [get(m) for m in metrics]
    names = [m.name for m in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup or "loss" in names:
        raise ValueError(
            f"metrics {names} log under duplicate or reserved names {dup or ['loss']}; give "
            "each metric a distinct name= (\"loss\" is the training loss)"
        )
    return out
