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

Keras-style metrics: a subclass that defines ``update_state`` and ``result`` (not
``batch_totals``) and keeps its state in ``self.add_weight(...)`` / ``self.add_variable(...)``
variables, as the Keras guides write it, works too. Its variables *are* its totals: they are
summed across replicas (Keras 3's metric variables have ``aggregation="sum"``; ``"mean"`` divides
the sum by the number of replicas), and ``result()`` runs the subclass's ``result`` with each
variable reading its global value, as a Keras metric variable (``synchronization="on_read"``)
reads under a tf.distribute strategy. Its ``update_state`` runs after every step (it is not
assumed additive).

In ``fit`` / ``evaluate``, as in Keras, ``metrics=`` are updated *without* sample weights (nor
class weights) and ``weighted_metrics=`` with them (``compile_metrics``).

Keras's count-based metrics (``AUC``, ``Precision``, ``Recall``, ``F1Score``, ``MeanIoU``, ...)
live in ``confusion_metrics``; ``get`` takes their names as Keras 3's ``keras.metrics.get`` does,
and torchmetrics metric objects (``torchmetrics_metric``).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from stratagem.core.eager import eager_only
from stratagem.distribute import current
from stratagem.distribute.loss import examples_in_step
from stratagem.distribute.strategy import Strategy

__all__ = [
    "Accuracy",
    "MetricVariable",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "KerasAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanSquaredError",
    "Metric",
    "SparseCategoricalAccuracy",
    "Sum",
    "TopKCategoricalAccuracy",
    "compile_metrics",
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


class Metric(abc.ABC):  # noqa: B024 (Keras-style subclasses define update_state/result instead of batch_totals)
    """A streaming metric: ``update_state`` per batch, ``result`` for all replicas, ``reset_state``.

    Two ways to write one: stratagem's (``batch_totals`` returning a batch's float64 totals, and
    ``compute`` from totals), or Keras's (``add_weight`` variables in ``__init__``,
    ``update_state`` assigning to them, ``result`` reading them; see the module docstring)."""

    #: How many float64 totals the state holds.
    num_totals: int = 2
    #: The key under which ``fit`` logs the metric when no ``name`` is given.
    default_name: str = "metric"
    #: Whether a batch's totals are the sum of its examples' totals (true of every built-in
    #: metric), so that one update with several batches concatenated along the batch dimension
    #: gives the totals of one update per batch: ``fit`` then updates it once per execution.
    additive: bool = False
    #: Whether the class is written as Keras writes metrics (``update_state`` / ``result`` over
    #: ``add_weight`` variables, no ``batch_totals``); set for each subclass when it is defined.
    _keras_style: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._keras_style = cls.batch_totals is Metric.batch_totals
        if not cls._keras_style:
            return
        if "default_name" not in cls.__dict__:
            cls.default_name = _snake_case(cls.__name__)  # Keras's auto_name
        for name in ("update_state", "result", "reset_state"):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_sg_wrapped", False):
                setattr(cls, name, _KERAS_WRAPPERS[name](fn))

    def __init__(self, name: str | None = None, dtype: Any = None) -> None:
        self.name = name if name is not None else self.default_name
        self.dtype: torch.dtype = _dtype(dtype)
        self._totals = torch.zeros(self.num_totals, dtype=torch.float64)
        self._pending: torch.Tensor | None = None  # totals added on the batch's device, not read yet
        self._global: torch.Tensor | None = None
        self._strategy: Strategy | None = None  # the strategy the last update ran under
        self._variables: list[MetricVariable] = []

    # --- Keras's metric variables ---------------------------------------------------------------
    def add_variable(
        self, shape: Any = (), initializer: Any = "zeros", dtype: Any = None, aggregation: str = "sum",
        name: str | None = None,
    ) -> MetricVariable:
        """A state variable (Keras's ``add_variable``): summed across replicas when read by
        ``result()`` (``aggregation="sum"``, Keras's default; ``"mean"``: the sum over the
        replicas divided by their number)."""
        if "_variables" not in self.__dict__:
            raise RuntimeError("You forgot to call `super().__init__()` in the `__init__()` method. Go add it!")
        if not self._keras_style:
            raise TypeError(
                f"{type(self).__name__} defines batch_totals (stratagem's form of a metric): its state is "
                "its totals; add_weight is for metrics written as Keras writes them (update_state and "
                "result over add_weight variables, no batch_totals)"
            )
        if aggregation not in ("sum", "mean"):
            raise ValueError(
                f"add_variable(aggregation={aggregation!r}) is not supported: a metric variable is summed "
                "across replicas ('sum', Keras's default) or averaged ('mean')"
            )
        shape = (shape,) if isinstance(shape, int) else tuple(shape or ())
        var = MetricVariable(_initial(initializer, shape, _dtype(dtype) if dtype is not None else self.dtype),
                             name or f"variable_{len(self._variables)}", aggregation)
        self._variables.append(var)
        self.num_totals = sum(v._value.numel() for v in self._variables)
        return var

    def add_weight(self, shape: Any = (), initializer: Any = "zeros", dtype: Any = None, name: str | None = None,
                   aggregation: str = "sum") -> MetricVariable:
        """Keras's ``add_weight`` (an alias of ``add_variable``)."""
        return self.add_variable(shape=shape, initializer=initializer, dtype=dtype, aggregation=aggregation, name=name)

    @property
    def variables(self) -> list[MetricVariable]:
        """The Keras-style state variables (empty for a metric that keeps stratagem's totals)."""
        return list(self._variables)

    def _flat(self, *, scaled: bool) -> torch.Tensor:
        """The variables as float64 totals (``scaled``: a ``"mean"`` variable's share of the sum)."""
        if not self._variables:
            return torch.zeros(0, dtype=torch.float64)
        parts = []
        for v in self._variables:
            t = v._value.detach().to("cpu", torch.float64).reshape(-1)
            if scaled and v.aggregation == "mean":
                replicas = self._strategy.num_replicas_in_sync if self._strategy is not None else 1
                t = t / replicas
            parts.append(t)
        return torch.cat(parts)

    def _set_flat(self, flat: torch.Tensor, *, add: bool = False) -> None:
        offset = 0
        for v in self._variables:
            n = v._value.numel()
            part = flat[offset : offset + n].reshape(v._value.shape).to(v._value.device, v._value.dtype)
            if add:
                v._value += part
            else:
                v._value = part.clone()
            offset += n

    @contextlib.contextmanager
    def _reading(self, totals: torch.Tensor) -> Iterator[None]:
        """Each variable reads its part of ``totals`` (new tensors: what ``result`` returns of
        them stays valid) while the block runs; then its own value again."""
        kept = [v._value for v in self._variables]
        self._set_flat(totals)
        try:
            yield
        finally:
            for v, value in zip(self._variables, kept):
                v._value = value

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
    def batch_totals(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The float64 totals one batch contributes (same arguments as ``update_state``).

        A Keras-style metric's: its variables after ``update_state`` on this batch alone (from
        zero), so summing them is Keras's ``aggregation="sum"``."""
        if type(self).update_state is Metric.update_state:
            raise NotImplementedError(
                f"{type(self).__name__} must define batch_totals (stratagem's form) or update_state and "
                "result (Keras's form)"
            )
        kept = [v._value for v in self._variables]
        for v in self._variables:
            v._value = torch.zeros_like(v._value)
        try:
            self.update_state(*args, **kwargs)
            return self._flat(scaled=False)
        finally:
            for v, value in zip(self._variables, kept):
                v._value = value

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
        if self._keras_style:
            self._set_flat(totals.detach().to("cpu", torch.float64), add=True)
            self._updated()
            return
        t = totals.detach()
        if t.dtype != torch.float64:
            t = t.to(torch.float64)
        if self._pending is None or self._pending.device != t.device:
            self._fold()
            self._pending = t.clone()
        else:
            self._pending += t
        self._updated()

    def _updated(self) -> None:
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
        if self._keras_style:
            raise NotImplementedError(f"{type(self).__name__} must define result() (Keras's form of a metric)")
        if self._global is not None:
            return self.compute(self._global)
        self._fold()
        return self.compute(_sum_across_replicas(self._totals, self._strategy))

    def _global_or_sum(self) -> torch.Tensor:
        """A Keras-style metric's variables summed across replicas (cached by ``sync_metrics``)."""
        if self._global is not None:
            return self._global
        return _sum_across_replicas(self._flat(scaled=True), self._strategy).to("cpu", torch.float64)

    def reset_state(self) -> None:
        """Forget every example seen (on this replica; call it on every replica). A Keras-style
        metric's variables are set to zero, as Keras's default ``reset_state`` does."""
        self._totals.zero_()
        for v in self._variables:
            v._value = torch.zeros_like(v._value)
        self._pending = None
        self._global = None

    def reset_states(self) -> None:
        """TF 2's name of ``reset_state`` (the tutorials call it)."""
        self.reset_state()

    def global_totals(self) -> torch.Tensor:
        """The totals cached by the last ``sync_metrics`` (this replica's if none since an update)."""
        if self._keras_style:
            return (self._global if self._global is not None else self._flat(scaled=True)).clone()
        self._fold()
        return (self._global if self._global is not None else self._totals).clone()

    def local_totals(self) -> torch.Tensor:
        """This replica's totals (a copy)."""
        if self._keras_style:
            return self._flat(scaled=True)
        self._fold()
        return self._totals.clone()

    def set_global_totals(self, totals: torch.Tensor) -> None:
        """Cache the totals summed across replicas (what ``sync_metrics`` computes)."""
        if totals.shape != (self.num_totals,):
            raise ValueError(f"{self.name}: expected {self.num_totals} totals, got shape {tuple(totals.shape)}")
        self._global = totals.detach().to("cpu", torch.float64).clone()

    def load_totals(self, totals: torch.Tensor) -> None:
        """Replace this replica's totals (used to resume a metric from a checkpoint)."""
        if self._keras_style:
            self._set_flat(totals.detach().to("cpu", torch.float64).reshape(self.num_totals))
            self._global = None
            return
        self._totals = totals.detach().to("cpu", torch.float64).clone().reshape(self.num_totals)
        self._pending = None
        self._global = None

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``update_state`` then ``result`` (so every replica must call it under a strategy)."""
        self.update_state(*args, **kwargs)
        return self.result()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# --- Keras-style metrics: variables, and the wrappers of a subclass's methods -----------------


def _snake_case(name: str) -> str:
    s = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", s).lower()


def _dtype(dtype: Any) -> torch.dtype:
    if dtype is None:
        return torch.float32  # Keras's floatx
    if isinstance(dtype, torch.dtype):
        return dtype
    got = getattr(torch, str(dtype), None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; give a torch.dtype or its name ('float32', 'int64')")
    return got


def _initial(initializer: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if initializer is None or initializer == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if initializer == "ones":
        return torch.ones(shape, dtype=dtype)
    if isinstance(initializer, (int, float)):
        return torch.full(shape, float(initializer), dtype=dtype)
    if isinstance(initializer, torch.Tensor):
        return initializer.detach().to(dtype).reshape(shape).clone()
    if callable(initializer):
        return torch.as_tensor(initializer(shape, dtype=dtype), dtype=dtype).reshape(shape).clone()
    raise ValueError(
        f"unknown initializer {initializer!r} for a metric variable; give 'zeros', 'ones', a number, a "
        "tensor or a callable (shape, dtype) -> tensor"
    )


def _unwrap(value: Any) -> Any:
    return value._value if isinstance(value, MetricVariable) else value


# in a compiled step a metric's batch totals are computed in the graph; adding them to the
# metric's state (Python attributes) and reading its result (a sync across replicas) run eagerly
eager_only(Metric, ["add_totals", "result"])


class MetricVariable:
    """A Keras-style metric's state variable (what ``Metric.add_weight`` returns): ``assign``,
    ``assign_add``, ``assign_sub``, ``value``, ``numpy()``; torch functions and arithmetic take it
    as its tensor. Not trainable; gradients never flow into it."""

    def __init__(self, value: torch.Tensor, name: str, aggregation: str = "sum") -> None:
        self._value = value
        self.name = name
        self.aggregation = aggregation

    @property
    def value(self) -> torch.Tensor:
        return self._value

    @property
    def shape(self) -> torch.Size:
        return self._value.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._value.dtype

    def _as(self, value: Any) -> torch.Tensor:
        t = _unwrap(value)
        t = t.detach() if isinstance(t, torch.Tensor) else torch.as_tensor(t)
        return t.to(self._value.device, self._value.dtype)

    def assign(self, value: Any) -> MetricVariable:
        self._value = self._as(value).expand(self._value.shape).clone()
        return self

    def assign_add(self, value: Any) -> MetricVariable:
        self._value = self._value + self._as(value)
        return self

    def assign_sub(self, value: Any) -> MetricVariable:
        self._value = self._value - self._as(value)
        return self

    def numpy(self) -> Any:
        return self._value.detach().cpu().numpy()

    def __array__(self, dtype: Any = None) -> Any:
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def __float__(self) -> float:
        return float(self._value)

    def __int__(self) -> int:
        return int(self._value)

    def __repr__(self) -> str:
        return f"<MetricVariable name={self.name} value={self._value.tolist()}>"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_map

        return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {}))

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._value[index]

    def __neg__(self) -> torch.Tensor:
        return -self._value


def _binary(op: Callable[[Any, Any], Any], reflected: bool) -> Callable[[MetricVariable, Any], Any]:
    if reflected:
        return lambda self, other: op(_unwrap(other), self._value)
    return lambda self, other: op(self._value, _unwrap(other))


for _name, _op in (("add", lambda a, b: a + b), ("sub", lambda a, b: a - b), ("mul", lambda a, b: a * b),
                   ("truediv", lambda a, b: a / b), ("floordiv", lambda a, b: a // b), ("pow", lambda a, b: a**b)):
    setattr(MetricVariable, f"__{_name}__", _binary(_op, False))
    setattr(MetricVariable, f"__r{_name}__", _binary(_op, True))
for _name, _op in (("lt", lambda a, b: a < b), ("le", lambda a, b: a <= b), ("gt", lambda a, b: a > b),
                   ("ge", lambda a, b: a >= b)):
    setattr(MetricVariable, f"__{_name}__", _binary(_op, False))


def _as_result(value: Any) -> Any:
    if isinstance(value, MetricVariable):
        return value._value.clone()
    if isinstance(value, Mapping):
        return {k: _as_result(v) for k, v in value.items()}
    return value


def _wrap_update(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def update_state(self: Metric, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            out = fn(self, *args, **kwargs)
        self._updated()
        return out

    update_state._sg_wrapped = True  # type: ignore[attr-defined]
    return update_state


def _wrap_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def result(self: Metric) -> Any:
        if self.__dict__.get("_sg_reading"):  # called from inside result (super().result()): as is
            return fn(self)
        self.__dict__["_sg_reading"] = True
        try:
            with self._reading(self._global_or_sum()):
                return _as_result(fn(self))
        finally:
            self.__dict__["_sg_reading"] = False

    result._sg_wrapped = True  # type: ignore[attr-defined]
    return result


def _wrap_reset(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def reset_state(self: Metric) -> Any:
        out = fn(self)
        self._global = None
        return out

    reset_state._sg_wrapped = True  # type: ignore[attr-defined]
    return reset_state


_KERAS_WRAPPERS = {"update_state": _wrap_update, "result": _wrap_result, "reset_state": _wrap_reset}


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
    parts = [m.local_totals() for m in metrics]
    flat = torch.cat([*parts, torch.tensor(list(extra), dtype=torch.float64)])
    if strategy.num_replicas_in_sync > 1:
        flat = strategy.reduce("sum", flat).to("cpu", torch.float64)
    offset = 0
    for m, part in zip(metrics, parts):
        m.set_global_totals(flat[offset : offset + part.numel()])
        offset += part.numel()
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
    #: Keras's function for this metric averages over the last axis (``axis=-1``): given 1-D
    #: labels and 1-D predictions it returns one number per batch, and its ``Mean`` counts the
    #: batch as one sample (see ``batch_totals``)
    keras_reduces_last_axis = False

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
        if self.keras_reduces_last_axis and yt.dim() == 1 and yp.dim() == 1 and sample_weight is None:
            return self._one_sample_per_batch(scores)
        if sample_weight is None:
            total = scores.sum()
            return torch.stack((total, total.new_full((), float(scores.shape[0]))))
        w = _weights(sample_weight, scores.shape[0], scores)
        return torch.stack([(scores * w).sum(), w.sum()])


    def _one_sample_per_batch(self, scores: torch.Tensor) -> torch.Tensor:
        """Keras on 1-D labels and 1-D predictions: the batch's mean, counted as one sample (so a
        smaller last batch weighs as much as a full one). The batch is the global batch: each
        replica adds its share of the step's mean and of the one sample, so the result is the
        single-device one on the global batch (TF's own, under a strategy, counts every replica's
        slice as a sample and changes with the number of replicas). Unweighted only: Keras fails
        on sample weights here; with weights each example counts (the weighted mean)."""
        local = int(scores.shape[0])
        total = examples_in_step(local)
        if total == 0:
            return torch.zeros(2, dtype=torch.float64, device=scores.device)
        return torch.stack((scores.sum() / total, scores.new_full((), local / total)))


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
        return _per_example_mean(in_top_k(labels, y_pred, self.k))


def in_top_k(labels: torch.Tensor, predictions: torch.Tensor, k: int) -> torch.Tensor:
    """Keras's ``in_top_k``: whether each label's prediction is at least the k-th highest of its
    row (a tie with the k-th counts as in the top k)."""
    kth = predictions.topk(min(k, predictions.shape[-1]), dim=-1).values[..., -1:]
    return (predictions.gather(-1, labels.long().unsqueeze(-1)) >= kth).squeeze(-1)


class MeanSquaredError(_PerExample):
    """Mean over examples of the mean squared error over each example's values.
    With 1-D labels and 1-D predictions, Keras's count: each batch is one sample."""

    additive = False  # 1-D inputs count batches: one update per step (keras_reduces_last_axis)
    keras_reduces_last_axis = True
    default_name = "mean_squared_error"

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        yt, yp = _squeeze_like(y_true, y_pred)
        return _per_example_mean((yp.to(torch.float64) - yt.to(torch.float64)) ** 2)


class MeanAbsoluteError(_PerExample):
    """Mean over examples of the mean absolute error over each example's values.
    With 1-D labels and 1-D predictions, Keras's count: each batch is one sample."""

    additive = False  # 1-D inputs count batches: one update per step (keras_reduces_last_axis)
    keras_reduces_last_axis = True
    default_name = "mean_absolute_error"

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        yt, yp = _squeeze_like(y_true, y_pred)
        return _per_example_mean((yp.to(torch.float64) - yt.to(torch.float64)).abs())


class MeanAbsolutePercentageError(_PerExample):
    """Keras's MAPE: mean over examples of ``100 * mean(|y_true - y_pred| / max(|y_true|, 1e-7))``
    over each example's values (Keras's epsilon, 1e-7). With 1-D labels and 1-D predictions,
    Keras's count: each batch is one sample."""

    additive = False  # 1-D inputs count batches: one update per step (keras_reduces_last_axis)
    keras_reduces_last_axis = True
    default_name = "mean_absolute_percentage_error"

    def per_example(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        yt, yp = _squeeze_like(y_true, y_pred)
        yt, yp = yt.to(torch.float64), yp.to(torch.float64)
        return 100.0 * _per_example_mean((yt - yp).abs() / yt.abs().clamp_min(1e-7))


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
    "mean_absolute_percentage_error": MeanAbsolutePercentageError,
    "mape": MeanAbsolutePercentageError,
}


def _by_name() -> dict[str, type[Metric]]:
    """Every metric name: these, and those of ``confusion_metrics`` (Keras's own spellings)."""
    from stratagem.train.confusion_metrics import BY_NAME

    return {**_BY_NAME, **BY_NAME}


def get(metric: Any) -> Metric:
    """A metric object from a metric, its name as Keras 3's ``keras.metrics.get`` takes it
    (``"sparse_categorical_accuracy"``, ``"mse"``, ``"auc"``, ``"AUC"``, ``"f1_score"``), or a
    torchmetrics metric object (``stratagem.train.torchmetrics_metric.TorchMetric``)."""
    if isinstance(metric, Metric):
        return metric
    if isinstance(metric, str):
        names = _by_name()
        cls = names.get(metric) or _BY_NAME.get(metric.lower())
        if cls is not None:
            return cls()
    from stratagem.train.torchmetrics_metric import TorchMetric, is_torchmetric

    if is_torchmetric(metric):
        return TorchMetric(metric)
    raise ValueError(
        f"unknown metric {metric!r}; pass a stratagem.metrics.Metric, a torchmetrics metric object or one of "
        f"{sorted(_by_name())}"
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


# --- what fit / evaluate track: Keras's CompileMetrics ---------------------------------------

_WHOLE = "__whole__"  # a FitMetric's output: the whole y / y_pred (a single-output model)


def _select(value: Any, key: Any) -> Any:
    if key == _WHOLE:
        return value
    try:
        return value[key]
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(
            f"a metric was given for output {key!r}, but the model's outputs or labels ({type(value).__name__}) "
            "have no such entry; key per-output metrics as the outputs are keyed (a dict's keys, a "
            "tuple's positions)"
        ) from e


class FitMetric(Metric):
    """One metric as fit and evaluate track it (Keras's ``CompileMetrics`` entry): the metric
    given, the name it logs under, the output it reads (the whole ``y`` / ``y_pred``, or one
    output of several) and whether it gets the sample weights (``weighted_metrics=``) or not
    (``metrics=``, as in Keras). Its state is the metric's own (read it from the object you
    gave)."""

    def __init__(self, metric: Metric, log_name: str, *, weighted: bool, output: Any = _WHOLE) -> None:
        self.metric = metric
        super().__init__(log_name)
        self.weighted = weighted
        self.output = output
        self.additive = metric.additive and output == _WHOLE

    @property
    def num_totals(self) -> int:
        """The metric's (a lazily built one, like Keras's F1Score, knows it after its first batch)."""
        return self.metric.num_totals

    @num_totals.setter
    def num_totals(self, value: int) -> None:
        raise AttributeError("a FitMetric's num_totals is its metric's; set it on the metric")

    def _args(self, y_true: Any, y_pred: Any, sample_weight: Any) -> tuple[Any, Any, dict[str, Any]]:
        if self.output == _WHOLE:
            if isinstance(y_pred, (Mapping, tuple, list)) and not self.metric._keras_style:
                raise ValueError(
                    f"metric {self.name!r} was given for the whole model, but the model has several outputs "
                    f"({type(y_pred).__name__}); give the metrics per output: metrics={{output: [metrics]}} "
                    "(a dict's keys) or a list with one list of metrics per output"
                )
            yt, yp, sw = y_true, y_pred, sample_weight
        else:
            yt, yp = _select(y_true, self.output), _select(y_pred, self.output)
            sw = _select(sample_weight, self.output) if isinstance(sample_weight, (Mapping, tuple, list)) else sample_weight
        # Keras: metrics= are updated without sample weights, weighted_metrics= with them
        return yt, yp, ({"sample_weight": sw} if self.weighted else {})

    def batch_totals(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        yt, yp, kw = self._args(y_true, y_pred, sample_weight)
        return self.metric.batch_totals(yt, yp, **kw)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        yt, yp, kw = self._args(y_true, y_pred, sample_weight)
        self.metric.update_state(yt, yp, **kw)

    def add_totals(self, totals: torch.Tensor) -> None:
        self.metric.add_totals(totals)

    def result(self) -> Any:
        return self.metric.result()

    def reset_state(self) -> None:
        self.metric.reset_state()

    def global_totals(self) -> torch.Tensor:
        return self.metric.global_totals()

    def local_totals(self) -> torch.Tensor:
        return self.metric.local_totals()

    def set_global_totals(self, totals: torch.Tensor) -> None:
        self.metric.set_global_totals(totals)

    def load_totals(self, totals: torch.Tensor) -> None:
        self.metric.load_totals(totals)

    def get_config(self) -> dict[str, Any]:
        return self.metric.get_config()

    def __repr__(self) -> str:
        return f"FitMetric({self.metric!r}, name={self.name!r}, weighted={self.weighted})"


def _named(identifier: Metric | str) -> Metric:
    """A metric object; one made from a name logs under that name, as Keras names it."""
    m = get(identifier)
    if isinstance(identifier, str):
        m.name = identifier
    return m


def _per_output(spec: Any, output_names: Sequence[str] | None, argument: str) -> list[tuple[Any, str | None, list[Any]]]:
    """``[(output key, output name for logs, [metric identifiers])]`` from ``metrics=``."""

    def as_list(v: Any) -> list[Any]:
        if v is None:
            return []
        return list(v) if isinstance(v, (list, tuple)) else [v]

    if isinstance(spec, Mapping):
        return [(k, str(k), as_list(v)) for k, v in spec.items()]
    if isinstance(spec, (list, tuple)) and any(isinstance(v, (list, tuple, type(None))) for v in spec):
        if not all(isinstance(v, (list, tuple, type(None))) for v in spec):
            raise ValueError(
                f"{argument}={spec!r} mixes metrics and lists of metrics: give one flat list (the whole "
                "model's metrics) or one list per output"
            )
        names = list(output_names) if output_names else [None] * len(spec)
        if len(names) != len(spec):
            raise ValueError(f"{argument} has {len(spec)} lists for a model with output_names {list(names)}")
        return [(i, names[i], as_list(v)) for i, v in enumerate(spec)]
    if isinstance(spec, (str, Metric)):
        return [(_WHOLE, None, [spec])]
    return [(_WHOLE, None, as_list(spec))]


def compile_metrics(
    metrics: Any = (), weighted_metrics: Any = (), output_names: Sequence[str] | None = None
) -> list[FitMetric]:
    """What fit / evaluate track for ``metrics=`` and ``weighted_metrics=``, named as Keras 3's
    ``CompileMetrics`` names them: a metric given by name logs under that name (``"mae"``, not
    ``"mean_absolute_error"``), an object under its ``name``; a per-output metric (``metrics=``
    a dict ``{output: [metrics]}`` or a list of lists, one per output) under
    ``"{output}_{name}"`` (a tuple's outputs have no name unless ``output_names`` gives them); a
    name taken again gets ``_1``, ``_2``, ..., and a weighted metric whose name is taken logs as
    ``weighted_{name}``. Unweighted ones come first, in the order given."""
    out: list[FitMetric] = []
    counters: dict[str, int] = {}
    seen: dict[int, str] = {}
    for weighted, spec, argument in ((False, metrics, "metrics"), (True, weighted_metrics, "weighted_metrics")):
        for key, output_name, identifiers in _per_output(spec, output_names, argument):
            for identifier in identifiers:
                m = _named(identifier)
                given = id(getattr(m, "wrapped", m))  # a torchmetrics object: the object given
                if given in seen:
                    raise ValueError(
                        f"the metric object {m!r} is given twice ({seen[given]} and {argument}); each place "
                        "needs its own object (one state per place), e.g. a second instance of its class"
                    )
                seen[given] = argument
                name = f"{output_name}_{m.name}" if output_name else m.name
                if name not in counters:
                    counters[name] = 1
                elif not weighted:
                    index = counters[name]
                    counters[name] += 1
                    name = f"{name}_{index}"
                else:
                    name = f"{output_name}_weighted_{m.name}" if output_name else f"weighted_{m.name}"
                    if name not in counters:
                        counters[name] = 1
                    else:
                        index = counters[name]
                        counters[name] += 1
                        name = f"{name}_{index}"
                if name == "loss":
                    raise ValueError(
                        f"metric {m!r} would log as 'loss', the training loss's name; give it another name="
                    )
                out.append(FitMetric(m, name, weighted=weighted, output=key))
    return out
