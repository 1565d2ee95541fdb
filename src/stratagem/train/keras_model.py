"""Keras's Model habits on a torch module: ``compile``, then ``fit``, ``evaluate``, ``predict``,
``save`` / ``load_weights`` and ``history`` on the model.

Three ways in, as Keras users and torch users have their models:

- subclass ``stratagem.Model`` instead of ``torch.nn.Module`` (Keras's subclassing habit; it *is*
  an ``nn.Module``: ``forward``, ``parameters()``, ``state_dict()`` as usual);
- ``stratagem.Sequential(layer, ...)`` (``nn.Sequential`` with the same methods);
- ``stratagem.keras_model(module)`` for a module someone else wrote (Hugging Face, timm): its
  class becomes a subclass of its own class and ``Model``, as torch's ``fully_shard`` does with
  ``FSDPModule``; nothing else about the module changes.

Each method is a thin layer over the functional ``stratagem.fit`` / ``evaluate`` / ``predict``
(which stay), so everything those do under a strategy holds here: global batch = ``batch_size``
(split across the replicas), single-device parity, exact resume. What Keras adds on the way:

- ``compile(optimizer, loss, metrics, loss_weights, steps_per_execution)``: optimizer names
  (``"adam"``) and recipes (``stratagem.optimizers.Adam(learning_rate=...)``, schedules stepped
  per update) are built over the model's parameters here, inside the scope of the strategy that
  made the model; loss names mean what they mean in Keras; a dict or list of losses applies one
  per output (weighted by ``loss_weights``, summed).
- the array form: ``fit(x, y, batch_size=32, validation_split=, shuffle=, sample_weight=,
  class_weight=, validation_data=(x_val, y_val))``; ``validation_split`` takes the *last* part of
  the arrays before shuffling, as Keras does; ``shuffle=True`` reshuffles every epoch from a seed
  drawn from torch's generator on the chief (``torch.manual_seed`` makes runs repeat);
  ``validation_data`` is checked against the training arrays before training starts.
- ``evaluate`` returns the loss alone, or ``[loss, *metrics]`` (``return_dict=True``: a dict).

``model.compile`` is Keras's: torch's in-place ``nn.Module.compile`` is ``torch.compile(model)``.
``save(path)`` writes the weights and the compile arguments, not the architecture (torch has no
portable one): ``stratagem.load_model(path, model=MyModel(...))`` loads them into a model rebuilt
in code (a class with Keras's ``get_config`` / ``from_config`` is rebuilt without it).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stratagem.distribute.strategy import Execution
from stratagem.train import optimizers as optimizers_mod
from stratagem.train.callback import Callback
from stratagem.train.fit import DEFAULT_BATCH_SIZE, evaluate_logs
from stratagem.train.fit import fit as fit_fn
from stratagem.train.fit import predict as predict_fn
from stratagem.train.history import History
from stratagem.train.losses import Loss, per_example_loss
from stratagem.train.losses import get as get_loss
from stratagem.train.metrics import Mean, Metric, compile_metrics
from stratagem.train.model_api import ModelAPI, apply_trainable, record_input
from stratagem.train.overrides import CompileMetrics

__all__ = ["Model", "Sequential", "keras_model", "load_model", "register_keras_serializable"]

_WEIGHTS = "model.weights"  # the checkpoint inside a saved model's directory
_CONFIG = "config.json"


class _Compiled:
    """What ``compile`` was given, resolved."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, optimizer_arg: Any, loss: Any, loss_arg: Any,
                 metrics: Any, loss_weights: Any, steps_per_execution: int | str, weighted_metrics: Any = None,
                 jit_compile: bool = False) -> None:
        self.optimizer = optimizer
        self.optimizer_arg = optimizer_arg
        self.loss = loss
        self.loss_arg = loss_arg
        self.metrics = metrics
        self.weighted_metrics = weighted_metrics
        self.loss_weights = loss_weights
        self.steps_per_execution = steps_per_execution
        self.jit_compile = jit_compile


class _OutputsLoss(Loss):
    """One loss per output of a model with several (a dict or a tuple of outputs), weighted and
    summed as Keras sums them: ``sum_k w_k * loss_k``, each ``loss_k`` the mean over the batch."""

    def __init__(self, losses: Mapping[Any, Any], weights: Mapping[Any, float],
                 names: Mapping[Any, str] | None = None) -> None:
        super().__init__(name="loss")
        self.losses = dict(losses)
        self.weights = dict(weights)
        self.names = dict(names or {k: str(k) for k in self.losses})

    def output_metrics(self, output_names: Sequence[str] | None = None) -> list[Metric]:
        """Keras's per-output loss logs (``"{output}_loss"``, only with several losses): each
        output's loss with the sample weights, before ``loss_weights`` (Keras records them
        unweighted by ``loss_weights``). A tuple's outputs are named by ``output_names`` (the
        model's), else by their loss's name, as Keras names a subclassed model's."""
        if len(self.losses) < 2:
            return []
        out: list[Metric] = []
        taken: set[str] = set()
        for key, loss in self.losses.items():
            name = self.names[key]
            if isinstance(key, int) and output_names is not None and key < len(output_names):
                name = str(output_names[key])
            log = f"{name}_loss"
            index = 1
            while log in taken:  # Keras would log one of two same-named losses; both kept here
                log, index = f"{name}_loss_{index}", index + 1
            taken.add(log)
            out.append(_OutputLossMetric(key, loss, log))
        return out

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return self.per_example(y_true, y_pred)

    def per_example(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        total: torch.Tensor | None = None
        for key, loss in self.losses.items():
            try:
                out, y = y_pred[key], y_true[key]
            except (KeyError, IndexError, TypeError) as e:
                raise ValueError(
                    f"compile was given a loss for output {key!r}, but the model's outputs "
                    f"({_describe(y_pred)}) or the labels ({_describe(y_true)}) have no such entry"
                ) from e
            term = per_example_loss(loss, out, y) * self.weights.get(key, 1.0)
            total = term if total is None else total + term
        assert total is not None
        return total


class _OutputLossMetric(Metric):
    """One output's loss, weighted by the sample weights (Keras's per-output loss tracker: the
    mean over the examples of ``w * loss``)."""

    def __init__(self, key: Any, loss: Any, name: str) -> None:
        super().__init__(name)
        self.key, self.loss = key, loss

    def batch_totals(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        if isinstance(sample_weight, (Mapping, tuple, list)):
            sample_weight = sample_weight[self.key]
        losses = per_example_loss(self.loss, y_pred[self.key], y_true[self.key], sample_weight).detach().to(torch.float64)
        total = losses.sum()  # sum(w * l) over the batch's examples, and their count
        return torch.stack((total, total.new_full((), float(losses.shape[0]))))

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name}


def _loss_name(identifier: Any, resolved: Any) -> str:
    if isinstance(identifier, str):
        return identifier
    name = getattr(resolved, "name", None)
    if isinstance(name, str) and name != "loss":
        return name
    return _snake(type(resolved).__name__)


def _snake(name: str) -> str:
    import re

    s = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", s).lower()


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(value)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _resolve_loss(loss: Any, loss_weights: Any) -> Any:
    if isinstance(loss, Mapping) or (isinstance(loss, (list, tuple)) and not isinstance(loss, str)):
        keys = list(loss) if isinstance(loss, Mapping) else list(range(len(loss)))
        losses = {k: get_loss(loss[k]) for k in keys}
        if loss_weights is None:
            weights = {k: 1.0 for k in keys}
        elif isinstance(loss_weights, Mapping):
            unknown = sorted(set(loss_weights) - set(keys), key=str)
            if unknown:
                raise ValueError(f"loss_weights names outputs {unknown} that have no loss; the losses are for {keys}")
            weights = {k: float(loss_weights.get(k, 1.0)) for k in keys}
        else:
            if len(loss_weights) != len(keys):
                raise ValueError(f"loss_weights has {len(loss_weights)} entries for {len(keys)} losses")
            weights = {k: float(w) for k, w in zip(keys, loss_weights)}
        names = {k: (str(k) if isinstance(loss, Mapping) else _loss_name(loss[k], losses[k])) for k in keys}
        return _OutputsLoss(losses, weights, names)
    if loss_weights is not None:
        w = loss_weights if isinstance(loss_weights, (int, float)) else None
        if w is None:
            raise ValueError(
                f"loss_weights {loss_weights!r} is for several outputs, but compile was given one loss; "
                "give a list or dict of losses, one per output"
            )
        base = get_loss(loss)
        return _Scaled(base, float(w))
    return get_loss(loss) if loss is not None else None


class _Scaled(Loss):
    """A single loss times a number (``loss_weights=w`` with one loss)."""

    def __init__(self, loss: Any, weight: float) -> None:
        super().__init__(name="loss")
        self.loss, self.weight = loss, weight

    def call(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return self.per_example(y_true, y_pred)

    def per_example(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        return per_example_loss(self.loss, y_pred, y_true) * self.weight


# --- arrays: Keras's form of x, y ------------------------------------------------------------
def _is_array(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(value, Mapping) and value:
        return all(isinstance(v, (torch.Tensor, np.ndarray)) for v in value.values())
    if isinstance(value, (list, tuple)) and value:
        return all(isinstance(v, (torch.Tensor, np.ndarray)) for v in value)
    return False


def _tensor(value: Any) -> Any:
    """Numpy as tensors (floats as float32, as Keras's default floatx); structure kept."""
    if isinstance(value, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(value))
        return t.float() if t.is_floating_point() and t.dtype == torch.float64 else t
    if isinstance(value, Mapping):
        return {k: _tensor(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_tensor(v) for v in value)
    return value


def _rows(value: Any) -> set[int]:
    if isinstance(value, torch.Tensor):
        return {int(value.shape[0])} if value.dim() else {-1}
    if isinstance(value, Mapping):
        return set().union(*(_rows(v) for v in value.values()))
    if isinstance(value, (list, tuple)):
        return set().union(*(_rows(v) for v in value))
    return set()


def _take(value: Any, index: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value[index]
    if isinstance(value, Mapping):
        return {k: _take(v, index) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_take(v, index) for v in value)
    return value


def _shapes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape[1:])
    if isinstance(value, Mapping):
        return {k: _shapes(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_shapes(v) for v in value)
    return None


def _check_batch_size(batch_size: Any, what: str) -> int:
    if batch_size is None:
        return DEFAULT_BATCH_SIZE
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{what}: batch_size must be a positive integer or None, got {batch_size!r}")
    return batch_size


class _ArrayEpochs:
    """Global batches of in-memory arrays, reshuffled each pass from ``(seed, pass)`` as Keras
    reshuffles each epoch; the same batches for the same pass (so a resumed run replays exactly)."""

    def __init__(self, arrays: tuple[Any, ...], batch_size: int, shuffle: bool, seed: int) -> None:
        self.arrays = arrays
        self.n = _rows(arrays).pop()
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._passes = 0

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def order(self, p: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed + 1_000_003 * p)
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Any:
        p = self._passes
        self._passes += 1
        order = self.order(p)
        for i in range(0, self.n, self.batch_size):
            yield _take(self.arrays, order[i : i + self.batch_size])


def _array_data(x: Any, y: Any, sample_weight: Any, what: str) -> tuple[Any, ...]:
    x = _tensor(x)
    arrays: tuple[Any, ...] = (x,)
    if y is not None:
        arrays += (_tensor(y),)
    if sample_weight is not None:
        if y is None:
            raise ValueError(f"{what}: sample_weight needs y (the labels the weights belong to)")
        arrays += (_tensor(sample_weight),)
    rows = _rows(arrays)
    if len(rows) != 1 or -1 in rows:
        names = ["x", "y", "sample_weight"][: len(arrays)]
        got = ", ".join(f"{n}: {sorted(_rows(a))}" for n, a in zip(names, arrays))
        raise ValueError(f"{what}: x, y and sample_weight must have the same number of rows (samples); got {got}")
    return arrays


def _agreed_seed(strategy: Any) -> int:
    """A seed for this fit's shuffles: drawn from torch's generator, the chief's on every replica."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    if strategy is not None and strategy.num_replicas_in_sync > 1 and strategy.extended.execution is not Execution.COORDINATED:
        t = torch.tensor([seed if strategy.extended.should_checkpoint else 0], dtype=torch.int64)
        seed = int(strategy.reduce("sum", t).item())
    return seed


# --- the model ---------------------------------------------------------------------------------
class Model(ModelAPI, nn.Module):
    """A torch module with Keras's ``compile`` / ``fit`` / ``evaluate`` / ``predict`` / ``save``.

    Subclass it as you would ``nn.Module`` (``__init__`` + ``forward``), or use ``Sequential`` or
    ``keras_model(module)``. As in Keras, a subclass may override ``train_step(data)``,
    ``test_step(data)`` and ``predict_step(data)``: fit, evaluate and predict then call them for
    every batch (each replica on its share; see ``stratagem.train.overrides``), with Keras's
    helpers: ``self(x, training=True)``, ``compute_loss``, ``trainable_weights``,
    ``self.optimizer.apply(grads, weights)``, ``self.metrics`` and ``compute_metrics``."""

    history: History | None
    stop_training: bool

    # state lives in __dict__ and is made on first use: a module given these methods by
    # keras_model() never ran this class's __init__
    def _keras(self) -> dict[str, Any]:
        state = self.__dict__.get("_sg_keras")
        if state is None:
            state = {"compiled": None}
            self.__dict__["_sg_keras"] = state
            self.__dict__.setdefault("history", None)
            self.__dict__.setdefault("stop_training", False)
        return state

    def _compiled(self, what: str) -> _Compiled:
        compiled = self._keras()["compiled"]
        if compiled is None:
            raise RuntimeError(f"You must call `compile()` before using the model ({what}).")
        return compiled

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        compiled = self._keras()["compiled"]
        return None if compiled is None else compiled.optimizer

    @property
    def loss(self) -> Any:
        compiled = self._keras()["compiled"]
        return None if compiled is None else compiled.loss_arg

    @property
    def compiled_metrics(self) -> list[Any]:
        compiled = self._keras()["compiled"]
        return [] if compiled is None else list(compiled.metrics)

    @property
    def metrics_names(self) -> list[str]:
        """``["loss", *metric names]``: the order ``evaluate`` returns its values in."""
        return list(self._keras().get("metrics_names", ["loss"]))

    @property
    def metrics(self) -> list[Any]:
        """Keras's ``model.metrics``: the loss tracker (``"loss"``) and the compiled metrics (one
        ``compile_metrics`` entry), once compiled; reset at each epoch's start and evaluate's.
        Override it to list the metrics an own ``train_step`` updates."""
        state = self._keras()
        if state["compiled"] is None:
            return []
        return [state["loss_tracker"], state["compile_metrics"]]

    def reset_metrics(self) -> None:
        """Reset ``self.metrics`` (Keras's: fit and evaluate do at their start)."""
        for m in self.metrics:
            m.reset_state()

    def get_metrics_result(self) -> dict[str, Any]:
        """``{name: result}`` of ``self.metrics`` (the compiled metrics' entries flattened)."""
        out: dict[str, Any] = {}
        for m in self.metrics:
            value = m.result()
            out.update(value if isinstance(value, Mapping) else {m.name: value})
        return out

    def __call__(self, *args: Any, training: bool | None = None, **kwargs: Any) -> Any:
        """Call the module; ``training=`` as Keras has it: passed on when ``forward`` takes it,
        else the call runs in that mode (``train()`` / ``eval()``) and the mode is restored."""
        if training is not None and _takes_training(type(self)):
            kwargs["training"] = training
        elif training is not None and bool(training) != self.training:
            was = self.training
            self.train(bool(training))
            try:
                return super().__call__(*args, **kwargs)
            finally:
                self.train(was)
        return super().__call__(*args, **kwargs)

    # --- the steps fit, evaluate and predict call (Keras's; override them) ----------------------
    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None,
                     training: bool = True) -> torch.Tensor:
        """The compiled loss of ``y_pred`` against ``y`` (Keras's ``compute_loss``): the mean over
        this batch of the weighted per-example losses (``sum(w * loss) / batch``, Keras's
        ``"sum_over_batch_size"``); ``sample_weight`` of shape ``(N,)`` or ``(N, 1)``."""
        del x, training
        compiled = self._compiled("compute_loss")
        if compiled.loss is None:
            raise ValueError("No loss to compute. Provide a `loss` argument in `compile()`.")
        losses = per_example_loss(compiled.loss, y_pred, y, sample_weight=sample_weight).float()
        return losses.sum() / max(int(losses.shape[0]), 1)

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> dict[str, Any]:
        """Update the compiled metrics with this batch; return ``get_metrics_result()`` (Keras's)."""
        del x
        self._compiled("compute_metrics")
        self._keras()["compile_metrics"].update_state(y, y_pred, sample_weight)
        return self.get_metrics_result()

    def train_step(self, data: Any) -> dict[str, Any]:
        """One training step on ``data`` (Keras 3's, on its torch backend): forward, ``compute_loss``,
        backward, ``optimizer.apply``, the metrics. fit runs an equal built-in step unless a
        subclass overrides this; an override may call ``super().train_step(data)``."""
        x, y, sw = _unpack(data)
        y_pred = self(x, training=True)
        self.zero_grad()
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw)
        self._keras()["loss_tracker"].update_state(loss.detach(), sample_weight=_rows_in(x))
        trainable = [w for w in self.trainable_weights]  # type: ignore[attr-defined]
        if trainable:
            loss.backward()
            with torch.no_grad():
                optimizers_mod.apply_update(self._compiled("train_step").optimizer,  # type: ignore[arg-type]
                                            [w.value.grad for w in trainable], trainable)
        return self.compute_metrics(x, y, y_pred, sample_weight=sw)

    def test_step(self, data: Any) -> dict[str, Any]:
        """One evaluation step (Keras's): forward, ``compute_loss``, the metrics."""
        x, y, sw = _unpack(data)
        y_pred = self(x, training=False)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=False)
        self._keras()["loss_tracker"].update_state(loss.detach(), sample_weight=_rows_in(x))
        return self.compute_metrics(x, y, y_pred, sample_weight=sw)

    def predict_step(self, data: Any) -> Any:
        """One prediction step (Keras's): the model's outputs for ``data``'s ``x``."""
        x, _, _ = _unpack(data)
        return self(x, training=False)

    @property
    def distribute_strategy(self) -> Any:
        from stratagem.distribute.ownership import strategy_of

        return strategy_of(self)

    def compile(  # type: ignore[override]
        self,
        optimizer: Any = "rmsprop",
        loss: Any = None,
        loss_weights: Any = None,
        metrics: Sequence[Any] | None = None,
        weighted_metrics: Sequence[Any] | None = None,
        run_eagerly: bool = False,
        steps_per_execution: int | str = 1,
        jit_compile: bool | str = "auto",
        auto_scale_loss: bool = True,
    ) -> None:
        """Configure the model for training (Keras's ``compile``; see the module's docstring)."""
        if jit_compile not in (True, False, "auto"):
            raise ValueError(f"compile: jit_compile must be True, False or 'auto', got {jit_compile!r}")
        del run_eagerly, auto_scale_loss  # fit runs eagerly; fp16 loss scaling is fit's precision=
        uninitialized = [n for n, p in self.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
        if uninitialized:
            raise ValueError(
                f"compile: the model has parameters whose shape is not known yet ({uninitialized[:3]}, from "
                "nn.Lazy* layers); run one batch through it first (model(x), inside strategy.scope() when "
                "there is a strategy), then compile"
            )
        built = self._build_optimizer(optimizer)
        resolved = _resolve_loss(loss, loss_weights)
        for argument, value in (("metrics", metrics), ("weighted_metrics", weighted_metrics)):
            if value is not None and not isinstance(value, (list, tuple, Mapping)):
                raise ValueError(
                    f"Expected `{argument}` argument to be a list, tuple, or dict. Received instead: "
                    f"{argument}={value!r} of type {type(value)}"
                )
        state = self._keras()
        state["compiled"] = _Compiled(
            built, optimizer, resolved, loss, metrics if metrics is not None else [], loss_weights,
            steps_per_execution, weighted_metrics if weighted_metrics is not None else [],
            jit_compile=jit_compile is True,
        )
        # Keras's loss tracker and compiled metrics, for the steps a subclass writes (the built-in
        # steps fit runs track their own copies)
        names = getattr(self, "output_names", None)
        state["loss_tracker"] = Mean(name="loss")
        state["compile_metrics"] = CompileMetrics(compile_metrics(
            copy.deepcopy(metrics or []), copy.deepcopy(weighted_metrics or []),
            names if isinstance(names, (list, tuple)) else None))

    def _build_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        strategy = self.distribute_strategy
        if strategy is None:
            return optimizers_mod.get(optimizer, self.parameters())
        with strategy.scope():  # the optimizer belongs to the model's strategy, as in Keras
            return optimizers_mod.get(optimizer, self.parameters())

    # --- fit / evaluate / predict ---------------------------------------------------------------
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: int | str = "auto",
        callbacks: Sequence[Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool | str = True,
        class_weight: dict[int, float] | None = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int = 1,
        *,
        lr_scheduler: Any = None,
        lr_scheduler_interval: str = "epoch",
    ) -> History:
        """Train the model (Keras's ``fit``): ``x``/``y`` arrays or tensors, or ``x`` a dataset of
        ``(x, y)`` / ``(x, y, sample_weight)`` batches. Returns the History (also ``model.history``).

        stratagem's addition: ``lr_scheduler`` (a torch ``LRScheduler`` over the compiled
        optimizer) stepped after every update with ``lr_scheduler_interval="step"``, or after
        every epoch (``"epoch"``); see ``stratagem.fit``."""
        compiled = self._compiled("fit")
        if validation_freq != 1:
            raise ValueError(
                f"fit(validation_freq={validation_freq!r}) is not offered: fit validates after every epoch; "
                "call model.evaluate(...) from a callback's on_epoch_end for another cadence"
            )
        if shuffle == "batch":
            raise ValueError("fit(shuffle='batch') is not offered (it exists in Keras for HDF5 files); use shuffle=True")
        if not isinstance(shuffle, bool | np.bool_):
            raise ValueError(f"fit(shuffle={shuffle!r}): shuffle is True or False")
        strategy = self.distribute_strategy
        apply_trainable(self)
        val = validation_data
        if _is_array(x):
            arrays = _array_data(x, y, sample_weight, "fit")
            record_input(self, arrays[0])
            if val is None and validation_split:
                if not 0.0 < validation_split < 1.0:
                    raise ValueError(f"fit: validation_split must be in (0, 1), got {validation_split}")
                n = _rows(arrays).pop()
                split_at = int(math.floor(n * (1.0 - validation_split)))
                if split_at == 0 or split_at == n:
                    raise ValueError(
                        f"Training data contains {n} samples, which is not sufficient to split it into a "
                        f"validation and training set as specified by `validation_split={validation_split}`. "
                        "Either provide more data, or a different value for the `validation_split` argument."
                    )
                val_arrays = _take(arrays, slice(split_at, n))
                arrays = _take(arrays, slice(0, split_at))
                val = _ArrayEpochs(val_arrays, _check_batch_size(validation_batch_size or batch_size, "fit"), False, 0)
            data: Any = _ArrayEpochs(arrays, _check_batch_size(batch_size, "fit"), bool(shuffle), _agreed_seed(strategy))
        else:
            if x is None:
                raise ValueError("fit: pass the training data as x (arrays, tensors or a dataset)")
            for name, value in (("y", y), ("sample_weight", sample_weight)):
                if value is not None:
                    raise ValueError(
                        f"fit: `{name}` argument is not supported when using a dataset as x; the dataset "
                        "yields (x, y) or (x, y, sample_weight) batches"
                    )
            if batch_size is not None:
                raise ValueError("fit: batch_size is for array inputs; a dataset already yields batches (leave it unset)")
            if validation_split:
                raise ValueError("fit: validation_split is only supported for tensors or numpy arrays, not a dataset")
            data = x
            arrays = None
        if val is not None and not isinstance(val, _ArrayEpochs):
            val = self._validation(val, arrays, validation_batch_size or batch_size)
        history = fit_fn(
            self, compiled.optimizer, compiled.loss, data,  # type: ignore[arg-type]
            epochs=epochs, validation_data=val, metrics=compiled.metrics,
            weighted_metrics=compiled.weighted_metrics, callbacks=list(callbacks or []),
            lr_scheduler=lr_scheduler, lr_scheduler_interval=lr_scheduler_interval,
            steps_per_epoch=steps_per_epoch, verbose=verbose, steps_per_execution=compiled.steps_per_execution,
            initial_epoch=initial_epoch, validation_steps=validation_steps, class_weight=class_weight,
            jit_compile=compiled.jit_compile,
        )
        self.__dict__["history"] = history
        names = history.params.get("metrics") or list(history.history)
        self._keras()["metrics_names"] = [n for n in names if not n.startswith("val_")]
        return history

    def _validation(self, val: Any, train: tuple[Any, ...] | None, batch_size: int | None) -> Any:
        """``validation_data`` as batches, checked before training starts."""
        if isinstance(val, (tuple, list)) and val and _is_array(val[0]):
            if len(val) not in (2, 3):
                raise ValueError(
                    f"fit: validation_data must be (x_val, y_val) or (x_val, y_val, val_sample_weight); got a "
                    f"{type(val).__name__} of {len(val)}"
                )
            arrays = _array_data(val[0], val[1], val[2] if len(val) == 3 else None, "fit(validation_data)")
            if train is not None:
                for i, name in enumerate(("x", "y")):
                    if i < len(train) and i < len(arrays) and _shapes(train[i]) != _shapes(arrays[i]):
                        raise ValueError(
                            f"fit: validation_data's {name} has samples of shape {_shapes(arrays[i])}, the "
                            f"training {name} of shape {_shapes(train[i])}; they must match"
                        )
            return _ArrayEpochs(arrays, _check_batch_size(batch_size, "fit(validation_data)"), False, 0)
        if batch_size is not None and train is None:
            raise ValueError("fit: validation_batch_size is for array validation_data")
        return val

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[Callback] | None = None,
        return_dict: bool = False,
    ) -> Any:
        """The loss and metrics over the data (Keras's ``evaluate``): the loss alone when there are no
        metrics, else ``[loss, *metrics]`` in ``metrics_names`` order; ``return_dict=True`` a dict."""
        compiled = self._compiled("evaluate")
        del verbose
        apply_trainable(self)
        if _is_array(x):
            data: Any = _ArrayEpochs(_array_data(x, y, sample_weight, "evaluate"), _check_batch_size(batch_size, "evaluate"), False, 0)
        else:
            if y is not None or sample_weight is not None:
                raise ValueError("evaluate: `y` and `sample_weight` are for array inputs; a dataset yields (x, y) batches")
            if batch_size is not None:
                raise ValueError("evaluate: batch_size is for array inputs; a dataset already yields batches")
            data = x
        logs, values = evaluate_logs(
            self, compiled.loss, data, metrics=copy.deepcopy(compiled.metrics),
            weighted_metrics=copy.deepcopy(compiled.weighted_metrics), steps=steps, callbacks=list(callbacks or []),
        )
        self._keras()["metrics_names"] = list(logs)
        if return_dict:
            return logs
        return values[0] if len(values) == 1 else values

    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        steps: int | None = None,
        callbacks: Sequence[Callback] | None = None,
    ) -> Any:
        """The model's outputs for every sample of ``x`` (Keras's ``predict``), in order."""
        del verbose
        if _is_array(x):
            record_input(self, _tensor(x))
            return predict_fn(self, _tensor(x), batch_size=_check_batch_size(batch_size, "predict"), steps=steps,
                              callbacks=list(callbacks or []))
        if batch_size is not None:
            raise ValueError("predict: batch_size is for array inputs; a dataset already yields batches")
        return predict_fn(self, x, steps=steps, callbacks=list(callbacks or []))

    # --- one batch (Keras's *_on_batch) ---------------------------------------------------------
    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None, class_weight: dict[int, float] | None = None,
                       return_dict: bool = False) -> Any:
        """One update on this global batch (Keras's ``train_on_batch``): the batch's loss, or
        ``[loss, *metrics]`` (``return_dict``: a dict); the metrics are reset first, as Keras 3's."""
        return self._on_batch("train", x, y, sample_weight, class_weight, return_dict)

    def test_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False) -> Any:
        """The loss and metrics on this global batch (Keras's ``test_on_batch``)."""
        return self._on_batch("test", x, y, sample_weight, None, return_dict)

    def predict_on_batch(self, x: Any) -> Any:
        """The model's outputs for this global batch (Keras's ``predict_on_batch``)."""
        from stratagem.train.fit import on_batch

        outputs, _ = on_batch(self, None, None, _tensor(x) if _is_array(x) else x, "predict")
        return outputs

    def _on_batch(self, what: str, x: Any, y: Any, sample_weight: Any, class_weight: Any, return_dict: bool) -> Any:
        from stratagem.train.fit import on_batch
        from stratagem.train.overrides import StepLogs, keras_order

        compiled = self._compiled(f"{what}_on_batch")
        apply_trainable(self)
        batch = _array_data(x, y, sample_weight, f"{what}_on_batch") if _is_array(x) else x
        self.reset_metrics()  # Keras 3 resets the metrics before each *_on_batch call
        logs, tracked = on_batch(self, compiled.optimizer, compiled.loss, batch, what, metrics=copy.deepcopy(compiled.metrics),
                                 weighted_metrics=copy.deepcopy(compiled.weighted_metrics), class_weight=class_weight)
        if return_dict:
            return logs
        if isinstance(tracked[0], StepLogs):
            values = keras_order(self, logs)
        else:
            from stratagem.train.fit import _in_keras_order

            values = _in_keras_order(logs, tracked)
        return values[0] if len(values) == 1 else values

    # --- saving ---------------------------------------------------------------------------------
    def save_weights(self, filepath: str | os.PathLike[str], overwrite: bool = True) -> None:
        """Save the weights to ``filepath`` (a stratagem checkpoint directory: safetensors + JSON).
        Call it on every replica."""
        _save_checkpoint(self, Path(filepath), overwrite)

    def load_weights(self, filepath: str | os.PathLike[str]) -> None:
        """Load weights saved by ``save_weights``, ``save``, ``ModelCheckpoint`` or a
        ``CheckpointManager`` (its directory: the newest). Call it on every replica."""
        from stratagem.train.callbacks import load_weights

        path = Path(filepath)
        if (path / _CONFIG).exists() and (path / _WEIGHTS).exists():
            path = path / _WEIGHTS
        load_weights(self, path)

    def save(self, filepath: str | os.PathLike[str], overwrite: bool = True, options: Any = None) -> None:
        """Save the model (Keras's ``model.save``): its weights, the compile arguments and the
        optimizer's state (Adam's moments, ``iterations``), so ``load_model`` continues training
        exactly as this model would. ``"m.keras"`` is one file (a zip of JSON and safetensors, no
        pickle); another path a directory of the same. The architecture is its class (rebuilt from
        ``register_keras_serializable``'s or the module's ``get_config()``), or pass ``model=`` to
        ``load_model``. Call it on every replica (the chief writes)."""
        from stratagem.train.export import SaveOptions, check_options

        check_options(options, SaveOptions, "save")  # experimental_io_device: this host, as always
        path = Path(filepath)
        if path.exists() and not overwrite:
            raise FileExistsError(f"save: {path} exists and overwrite=False")
        from stratagem.distribute.current import get_strategy

        strategy = self.distribute_strategy or get_strategy()
        chief = strategy.extended.should_checkpoint
        single = path.suffix == ".keras"
        directory = path.parent / f".staging-{path.name}.d" if single else path
        if single and path.is_dir():
            raise IsADirectoryError(f"save: {path} is a directory; a .keras model is one file (remove it or pick another name)")
        compiled = self._keras()["compiled"]
        _save_checkpoint(self, directory / _WEIGHTS, True, optimizer=compiled.optimizer if compiled is not None else None)
        try:
            if chief:
                config: dict[str, Any] = {
                    "class": f"{type(self).__module__}:{type(self).__qualname__}",
                    "registered": _registered_name(type(self)),
                    "keras_model_of": _base_class(self),
                    "config": _get_config(self),
                    "compile": _compile_config(compiled),
                    "optimizer_state": compiled is not None and compiled.optimizer is not None,
                }
                (directory / _CONFIG).write_text(json.dumps(config, indent=2, default=str))
                if single:
                    _zip_directory(directory, path)
        finally:
            strategy.barrier()
            if single and chief:
                shutil.rmtree(directory, ignore_errors=True)

def _takes_training(cls: type) -> bool:
    import inspect

    try:
        return "training" in inspect.signature(cls.forward).parameters  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return False


def _unpack(data: Any) -> tuple[Any, Any, Any]:
    """Keras's ``unpack_x_y_sample_weight``: ``(x,)``, ``(x, y)``, ``(x, y, w)`` or ``x`` alone."""
    if isinstance(data, list):
        data = tuple(data)
    if isinstance(data, tuple) and not hasattr(data, "_fields"):
        if len(data) == 1:
            return data[0], None, None
        if len(data) == 2:
            return data[0], data[1], None
        if len(data) == 3:
            return data[0], data[1], data[2]
        raise ValueError(f"Data is expected to be in format `x`, `(x,)`, `(x, y)`, or `(x, y, sample_weight)`, found a tuple of {len(data)}")
    return data, None, None


def _rows_in(x: Any) -> int:
    from stratagem.core import tree

    for t in tree.leaves(x):
        if isinstance(t, torch.Tensor) and t.dim():
            return int(t.shape[0])
    return 1


def _get_config(model: nn.Module) -> Any:
    get_config: Any = getattr(model, "get_config", None)
    return get_config() if callable(get_config) else None


def _base_class(model: nn.Module) -> str | None:
    """For a module given Keras's methods by keras_model(): the class it had."""
    cls = type(model)
    if getattr(cls, "_sg_keras_of", None) is not None:
        base = cls._sg_keras_of  # type: ignore[attr-defined]
        return f"{base.__module__}:{base.__qualname__}"
    return None


#: a compile argument that cannot be saved by name or config (a torch optimizer, a function)
_UNSAVED = {"unsaved": True}


def _serialize(value: Any) -> Any:
    """A compile argument as JSON: names and numbers as they are, objects with Keras's
    ``get_config`` as their class and config (rebuilt by ``_deserialize``), others unsaved."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_serialize(v) for v in value]
    if isinstance(value, Mapping):
        return {"dict": {str(k): _serialize(v) for k, v in value.items()}}
    get_config: Any = getattr(value, "get_config", None)
    cls = type(value)
    if callable(get_config) and "<locals>" not in cls.__qualname__:
        return {"class": f"{cls.__module__}:{cls.__qualname__}", "config": _serialize(get_config())["dict"]}
    return dict(_UNSAVED)


def _unsaved(value: Any) -> bool:
    if isinstance(value, list):
        return any(_unsaved(v) for v in value)
    if isinstance(value, dict):
        return value == _UNSAVED or any(_unsaved(v) for v in value.values())
    return False


def _deserialize(value: Any) -> Any:
    import importlib

    if isinstance(value, list):
        return [_deserialize(v) for v in value]
    if isinstance(value, dict) and "dict" in value:
        return {k: _deserialize(v) for k, v in value["dict"].items()}
    if isinstance(value, dict) and "class" in value:
        module_name, _, qualname = value["class"].partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        config = {k: _deserialize(v) for k, v in value["config"].items()}
        if hasattr(obj, "from_config"):
            return obj.from_config(config)
        return obj(**config)
    return value


def _compile_config(compiled: _Compiled | None) -> dict[str, Any] | None:
    if compiled is None:
        return None
    return {
        "optimizer": _serialize(compiled.optimizer_arg),
        "loss": _serialize(compiled.loss_arg),
        "metrics": _serialize(compiled.metrics),
        "weighted_metrics": _serialize(compiled.weighted_metrics),
        "loss_weights": _serialize(compiled.loss_weights),
        "steps_per_execution": compiled.steps_per_execution,
        "jit_compile": compiled.jit_compile,
    }


def _zip_directory(directory: Path, target: Path) -> None:
    """``directory``'s files as one zip at ``target`` (stored, not compressed; written to a
    temporary name, synced, then renamed into place)."""
    import zipfile

    partial = target.parent / f".{target.name}.partial"
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED) as z:
        for f in sorted(directory.rglob("*")):
            if f.is_file():
                z.write(f, f.relative_to(directory).as_posix())
    with open(partial, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(partial, target)


@contextlib.contextmanager
def _opened(path: Path) -> Any:
    """A saved model as a directory: itself, or a ``.keras`` file extracted to a private temporary
    one (every replica its own; member names checked to stay inside it)."""
    import tempfile
    import zipfile
    import zlib

    if path.is_dir():
        yield path
        return
    if not path.exists():
        raise FileNotFoundError(f"load_model: {path} does not exist")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"load_model: {path} is not a model saved by Model.save (not a .keras zip nor a directory)")
    with tempfile.TemporaryDirectory(prefix="stratagem-model-") as tmp:
        try:
            with zipfile.ZipFile(path) as z:
                for name in z.namelist():
                    target = (Path(tmp) / name).resolve()
                    if not str(target).startswith(str(Path(tmp).resolve()) + os.sep):
                        raise ValueError(f"load_model: {path} holds a member {name!r} outside the model; refusing it")
                z.extractall(tmp)
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise ValueError(f"load_model: {path} is damaged (cut short or altered): {type(e).__name__}: {e}") from e
        yield Path(tmp)


def _save_checkpoint(model: nn.Module, target: Path, overwrite: bool, optimizer: Any = None) -> None:
    """Write ``model``'s weights (and ``optimizer``'s state) as a stratagem checkpoint directory at
    ``target`` (every replica calls it; the chief writes and renames it into place)."""
    from stratagem.distribute.current import get_strategy
    from stratagem.distribute.ownership import strategy_of
    from stratagem.train.checkpoint import Checkpoint, CheckpointManager
    from stratagem.train.checkpoint.lock import replace_directory

    if target.exists() and not overwrite:
        raise FileExistsError(f"save_weights: {target} exists and overwrite=False")
    strategy = strategy_of(model) or get_strategy()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".staging-{target.name}"
    objects: dict[str, Any] = {"model": model} if optimizer is None else {"model": model, "optimizer": optimizer}
    manager = CheckpointManager(Checkpoint(**objects), staging, None, strategy=strategy)
    try:
        staged = Path(manager.save(0))
        if strategy.extended.should_checkpoint:
            replace_directory(staged, target)
    finally:
        manager.close()
        strategy.barrier()
        if strategy.extended.should_checkpoint:
            shutil.rmtree(staging, ignore_errors=True)


class Sequential(Model, nn.Sequential):
    """``nn.Sequential`` with Keras's ``compile`` / ``fit`` / ``evaluate`` / ``predict`` / ``save``."""

    def __init__(self, *layers: nn.Module) -> None:
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])  # Keras's Sequential([layer, ...])
        nn.Sequential.__init__(self, *layers)


_KERAS_CLASSES: dict[type, type] = {}


def keras_model(module: nn.Module) -> Model:
    """Give ``module`` Keras's methods (``compile``, ``fit``, ...) in place and return it.

    Its class becomes a subclass of its own class and ``Model`` (as torch's ``fully_shard`` makes
    a module an ``FSDPModule``): parameters, buffers, ``forward`` and ``state_dict`` keys are
    unchanged."""
    if isinstance(module, Model):
        return module
    if not isinstance(module, nn.Module):
        raise TypeError(f"keras_model takes a torch.nn.Module; got {type(module).__name__}")
    cls = type(module)
    keras_cls = _KERAS_CLASSES.get(cls)
    if keras_cls is None:
        keras_cls = type(cls.__name__, (cls, Model), {"_sg_keras_of": cls, "__module__": cls.__module__})
        keras_cls.__qualname__ = cls.__qualname__
        _KERAS_CLASSES[cls] = keras_cls
    module.__class__ = keras_cls
    return module  # type: ignore[return-value]


def load_model(filepath: str | os.PathLike[str], model: nn.Module | None = None, compile: bool = True,
               custom_objects: Mapping[str, Any] | None = None, options: Any = None) -> Model:
    """Keras's ``load_model`` for a model saved by ``Model.save`` (a ``.keras`` file or a
    directory): the model rebuilt from its registered class or ``get_config()`` (or ``model=``,
    built in code), its weights loaded, compiled again with the saved arguments, and the
    optimizer's state restored, so ``fit`` continues exactly as the saved model would have.
    ``custom_objects``: ``{name: class}`` for classes saved under a registered name; ``options``:
    ``stratagem.saved_model.LoadOptions`` (TF's; reads happen on this host)."""
    from stratagem.train.export import LoadOptions, check_options

    check_options(options, LoadOptions, "load_model")
    path = Path(filepath)
    with _opened(path) as directory:
        config_file = directory / _CONFIG
        if not config_file.exists():
            raise FileNotFoundError(
                f"load_model: {path} is not a model saved by Model.save (no {_CONFIG} in it); for weights "
                "saved by save_weights or ModelCheckpoint use model.load_weights(path)"
            )
        saved = json.loads(config_file.read_text())
        if model is None:
            model = _rebuild(saved, path, custom_objects)
        keras = keras_model(model)
        weights = directory / _WEIGHTS
        spec = saved.get("compile")
        if not (compile and spec is not None and saved.get("optimizer_state")):
            keras.load_weights(weights)  # else read once below, with the optimizer's state
        if compile and spec is not None:
            unsaved = [k for k in ("optimizer", "loss", "metrics", "weighted_metrics", "loss_weights") if _unsaved(spec.get(k))]
            if unsaved:
                raise ValueError(
                    f"load_model: {path} was compiled with {' and '.join(unsaved)} that cannot be saved (a torch "
                    "optimizer, a function, or an object without get_config); load with compile=False and "
                    "call model.compile(...) again"
                )
            from stratagem.distribute.ownership import strategy_of

            args = {k: _deserialize(spec.get(k)) for k in ("optimizer", "loss", "metrics", "weighted_metrics", "loss_weights")}
            strategy = strategy_of(keras)
            with strategy.scope() if strategy is not None else contextlib.nullcontext():
                keras.compile(optimizer=args["optimizer"], loss=args["loss"], metrics=args["metrics"] or None,
                              weighted_metrics=args["weighted_metrics"] or None,
                              loss_weights=args["loss_weights"], steps_per_execution=spec.get("steps_per_execution", 1),
                              jit_compile=spec.get("jit_compile", "auto"))
            if saved.get("optimizer_state"):
                from stratagem.train.checkpoint import Checkpoint

                # the weights with the optimizer's state: one checkpoint, read once
                Checkpoint(model=keras, optimizer=keras.optimizer).restore(weights)
    return keras


#: classes registered by ``register_keras_serializable``: "package>Name" -> class
_REGISTERED: dict[str, type] = {}


def register_keras_serializable(package: str = "Custom", name: str | None = None) -> Any:
    """Keras's ``@register_keras_serializable(package=, name=)``: ``load_model`` rebuilds the class
    by this name (``"package>Name"``) wherever it was defined, with ``from_config`` or
    ``cls(**get_config())``."""

    def register(cls: type) -> type:
        key = f"{package}>{name or cls.__name__}"
        if key in _REGISTERED and _REGISTERED[key] is not cls:
            raise ValueError(f"{key} has been already registered to {_REGISTERED[key]}")
        _REGISTERED[key] = cls
        return cls

    return register


def _registered_name(cls: type) -> str | None:
    for key, value in _REGISTERED.items():
        if value is cls:
            return key
    return None


def _rebuild(saved: Mapping[str, Any], path: Path, custom_objects: Mapping[str, Any] | None = None) -> nn.Module:
    import importlib

    name = saved.get("keras_model_of") or saved.get("class")
    registered = saved.get("registered")
    if registered:
        short = registered.split(">", 1)[1]
        found: Any = (custom_objects or {}).get(registered) or (custom_objects or {}).get(short) or _REGISTERED.get(registered)
        if found is None:
            raise ValueError(
                f"load_model: {path} holds a {registered}, registered with register_keras_serializable, but no "
                "class of that name is registered in this process: import the module that defines it, or pass "
                f"custom_objects={{{short!r}: TheClass}}"
            )
        config = saved.get("config") or {}
        return found.from_config(config) if hasattr(found, "from_config") else found(**config)  # type: ignore[no-any-return]
    if saved.get("config") is None:
        raise ValueError(
            f"load_model: {path} holds the weights of a {name}, but not its architecture (torch has no "
            f"portable form of it): rebuild it in code and pass it, load_model({str(path)!r}, "
            "model=MyModel(...)); or give the class Keras's get_config() so save records its arguments"
        )
    module_name, _, qualname = str(name).partition(":")
    if "<locals>" in qualname:
        raise ValueError(
            f"load_model: {path} holds a {qualname}, a class defined inside a function, which cannot be "
            "imported to rebuild it; pass the model: load_model(path, model=...)"
        )
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    config = saved["config"]
    if hasattr(obj, "from_config"):
        return obj.from_config(config)  # type: ignore[no-any-return]
    return obj(**config)  # type: ignore[no-any-return]
