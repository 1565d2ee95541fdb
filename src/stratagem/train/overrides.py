"""A model's own ``train_step`` / ``test_step`` / ``predict_step`` run by fit, evaluate and predict.

Keras 3 calls ``model.train_step(data)`` for every batch when a subclass overrides it (and
``test_step`` in evaluate and validation, ``predict_step`` in predict); the dict it returns is the
batch's logs. ``KerasSteps`` does the same beside the built-in ``DataParallelSteps``: each replica
calls the override on its share of the global batch, inside ``strategy.run``.

Under several replicas the override's ``loss.backward()`` is reduced like any step's, and the
override computes what Keras's do, a mean over *its* batch. So that the update equals one
device's on the global batch, each gradient a replica contributes is weighted by its share of the
global batch, ``n_r / n`` (a hook on every parameter of the model, set for each step), and the
reducer's sum is then the gradient of the global mean: ``sum_r (n_r / n) grad(mean_r)``. The logs
are averaged over the replicas when an execution ends (one collective, with fit's own sync), so
every replica's callbacks see the same numbers; values already global (a metric's ``result()``,
itself summed across replicas) stay as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.core.batches import batch_size_of
from stratagem.distribute import current
from stratagem.distribute.strategy import Execution, StateLayout, Strategy
from stratagem.train.metrics import Metric
from stratagem.train.steps import DataParallelSteps

__all__ = ["CompileMetrics", "KerasSteps", "StepLogs", "keras_order", "overridden", "overrides_any"]

_STEPS = ("train_step", "test_step", "predict_step")


def overridden(model: Any, name: str) -> bool:
    """Whether ``model``'s class overrides ``stratagem.Model``'s ``name`` (a step)."""
    from stratagem.train.keras_model import Model

    if not isinstance(model, Model):
        return False
    return getattr(type(model), name) is not getattr(Model, name)


def overrides_any(model: Any) -> bool:
    return any(overridden(model, n) for n in _STEPS)


def _flat_logs(logs: Any, what: str) -> dict[str, torch.Tensor]:
    """A step's returned logs as ``{name: float64 scalar}`` (nested dicts flattened, as Keras's
    ``_pythonify_logs``)."""
    if logs is None:
        return {}
    if not isinstance(logs, Mapping):
        raise TypeError(
            f"{what} must return a dict of logs ({{'loss': ..., 'mae': ...}}, as Keras's); got {type(logs).__name__}"
        )
    out: dict[str, torch.Tensor] = {}
    for key, value in logs.items():
        if isinstance(value, Mapping):
            out.update(_flat_logs(value, what))
            continue
        t = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        if t.numel() != 1:
            raise ValueError(
                f"{what} returned {key!r} of shape {tuple(t.shape)}; fit's logs hold one number per name "
                "(reduce it, or log each entry under a name of its own)"
            )
        out[str(key)] = t.reshape(()).to("cpu", torch.float64)
    return out


class StepLogs(Metric):
    """The logs the model's own step returned (Keras: the last step's dict), averaged over the
    replicas when fit or evaluate syncs. Totals: ``[replicas reporting, examples seen since the
    reset, value, ...]`` (the example count is where fit reads it, as from its loss metric)."""

    additive = False

    def __init__(self, model: nn.Module, what: str) -> None:
        super().__init__("logs")
        self.model, self.what = model, what
        self.keys: list[str] | None = None
        self._examples = 0.0
        self._values: torch.Tensor | None = None

    def record(self, logs: Any, examples: int) -> None:
        flat = _flat_logs(logs, self.what)
        if self.keys is None:
            self.keys = list(flat)
            self.num_totals = 2 + len(self.keys)
        elif list(flat) != self.keys:
            raise ValueError(
                f"{self.what} returned the logs {sorted(flat)} where an earlier step returned {sorted(self.keys)}; "
                "return the same names every step"
            )
        self._examples += examples
        self._values = torch.stack(list(flat.values())) if flat else torch.zeros(0, dtype=torch.float64)
        self._global = None

    def local_totals(self) -> torch.Tensor:
        values = self._values if self._values is not None else torch.zeros(self.num_totals - 2, dtype=torch.float64)
        reporting = 1.0 if self._values is not None else 0.0
        return torch.cat([torch.tensor([reporting, self._examples], dtype=torch.float64), values])

    def global_totals(self) -> torch.Tensor:
        return (self._global if self._global is not None else self.local_totals()).clone()

    def result(self) -> Any:
        totals = self.global_totals()
        n = float(totals[0])
        return {k: totals[2 + i] / n if n else totals[2 + i] for i, k in enumerate(self.keys or [])}

    def load_totals(self, totals: torch.Tensor) -> None:
        self._examples = float(totals[1])
        self._values = totals[2:].clone() if float(totals[0]) else None
        self._global = None

    def reset_state(self) -> None:
        """Keras's ``reset_metrics()`` at an epoch's start and evaluate's: the model's metrics."""
        self._examples, self._values, self._global = 0.0, None, None
        for m in _model_metrics(self.model):
            m.reset_state()


def _model_metrics(model: Any) -> list[Any]:
    metrics = getattr(model, "metrics", None)
    return list(metrics) if isinstance(metrics, (list, tuple)) else []


class _ShareOfBatch:
    """Hooks that weigh each gradient this replica contributes by its share of the global batch
    (``scale``: ``n_r / n`` while a step runs, else 1); an empty share contributes zeros."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.scale = 1.0
        self._handles = [p.register_hook(self._hook) for p in params if p.requires_grad]

    def _hook(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self.scale == 1.0:
            return None
        if self.scale == 0.0:
            return torch.zeros_like(grad)
        return grad * self.scale

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _examples(data: Any) -> int:
    leaf = data[0] if isinstance(data, (tuple, list)) and data else data
    try:
        return batch_size_of(leaf, "x")
    except ValueError:
        return 0


class KerasSteps(DataParallelSteps):
    """``DataParallelSteps`` that call the model's own steps where it overrides them."""

    def __init__(self, strategy: Strategy, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(strategy, model, *args, **kwargs)
        self.own_train = overridden(model, "train_step")
        self.own_test = overridden(model, "test_step")
        self.own_predict = overridden(model, "predict_step")
        self._share: _ShareOfBatch | None = None
        if self.own_train and self.optimizer is not None:
            # a whole model on every process, its gradients reduced parameter by parameter: the
            # share of each can be weighed (sharded parameters are reduced by FSDP's own hooks)
            if strategy.extended.state_layout is not StateLayout.MIRRORED:
                raise ValueError(
                    f"{type(model).__name__} overrides train_step, which fit runs under the default, OneDevice, "
                    f"Mirrored and MultiWorkerMirrored strategies; under {type(strategy).__name__} the "
                    "gradients are reduced by its own engine, which does not weigh an override's loss by each "
                    "replica's share yet. Use fit's built-in step (compile(loss=...)), or MirroredStrategy"
                )
            if self.pieces is not None:
                raise ValueError(
                    f"{type(model).__name__} overrides train_step, which fit cannot run with "
                    "enable_op_determinism or FailureOptions(on_failure='continue') yet (both cut the global "
                    "batch into pieces of their own); use the built-in step (compile(loss=...))"
                )
            if self.options.accumulate != 1 or self.options.clips or self.options.class_weight is not None:
                raise ValueError(
                    f"{type(model).__name__} overrides train_step: gradient_accumulation_steps, clipnorm, clipvalue, "
                    "global_clipnorm and class_weight are the built-in step's; do them in your train_step"
                )
            if self.policy.name != "32" or self.options.jit_compile:
                raise ValueError(
                    f"{type(model).__name__} overrides train_step: fit's precision= and jit_compile are the built-in "
                    "step's; use torch.autocast or stratagem.function inside your train_step"
                )
            if strategy.num_replicas_in_sync > 1 and strategy.extended.execution is not Execution.GLOBAL:
                self._share = _ShareOfBatch(list(model.parameters()))

    def close(self) -> None:
        if self._share is not None:
            self._share.remove()
            self._share = None

    def train(self, group: Sequence[Any], loss_metric: Metric, metrics: Sequence[Metric]) -> float:
        if not self.own_train:
            return super().train(group, loss_metric, metrics)
        assert isinstance(loss_metric, StepLogs)
        model, share, after = self.model, self._share, self.after_update
        local = [_examples(b) for b in group]
        totals = self._counts(local) if share is not None else local
        step: Callable[[Any], Any] = model.train_step  # type: ignore[assignment]
        t0 = time.perf_counter()

        def execution() -> None:
            for data, n_r, n in zip(group, local, totals):
                if share is not None:
                    share.scale = n_r / n if n else 0.0
                try:
                    logs = step(data)
                finally:
                    if share is not None:
                        share.scale = 1.0
                loss_metric.record(logs, n_r)
                if after is not None:
                    after()

        self.strategy.run(execution)
        return time.perf_counter() - t0

    def _counts(self, local: list[int]) -> list[int]:
        ctx = current.get_replica_context()
        if ctx is None:
            return [int(c) for c in self.strategy.reduce("sum", torch.tensor(local, dtype=torch.int64)).tolist()]
        return [int(c) for c in ctx.all_reduce("sum", torch.tensor(local, dtype=torch.int64)).tolist()]

    def test(self, batch: Any, loss_metric: Metric, metrics: Sequence[Metric]) -> None:
        if not self.own_test:
            return super().test(batch, loss_metric, metrics)
        assert isinstance(loss_metric, StepLogs)
        model = self.model

        def test_step(data: Any) -> None:
            with torch.no_grad():
                logs = model.test_step(data)  # type: ignore[operator]
            loss_metric.record(logs, _examples(data))

        self.strategy.run(test_step, args=(batch,))

    def predict(self, batch: Any) -> Any:
        if not self.own_predict:
            return super().predict(batch)
        from stratagem.train.outputs import for_gather

        model = self.model

        def predict_step(data: Any) -> Any:
            with torch.no_grad():
                return for_gather(model.predict_step(data))  # type: ignore[operator]

        return self.strategy.gather(self.strategy.run(predict_step, args=(batch,)), axis=0)


class CompileMetrics:
    """Keras's ``compile_metrics``: the metrics given to ``compile`` as one entry of
    ``model.metrics`` (``update_state(y, y_pred, sample_weight)`` updates them all, ``result()``
    is a dict of their values, global across replicas)."""

    name = "compile_metrics"

    def __init__(self, metrics: Sequence[Metric]) -> None:
        self.metrics = list(metrics)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        for m in self.metrics:
            m.update_state(y_true, y_pred, sample_weight=sample_weight)

    def result(self) -> dict[str, Any]:
        return {m.name: m.result() for m in self.metrics}

    def reset_state(self) -> None:
        for m in self.metrics:
            m.reset_state()

    def __repr__(self) -> str:
        return f"CompileMetrics({[m.name for m in self.metrics]})"


def keras_order(model: Any, logs: Mapping[str, float]) -> list[float]:
    """Keras's ``_flatten_metrics_in_order`` for an overriding model's logs: the names of
    ``model.metrics`` first (the compiled metrics by their own names), then the rest sorted."""
    names: list[str] = []
    for m in _model_metrics(model):
        names += [s.name for s in m.metrics] if isinstance(m, CompileMetrics) else [str(getattr(m, "name", ""))]
    values = [logs[n] for n in names if n in logs]
    values += [logs[k] for k in sorted(logs) if k not in names]
    return values

