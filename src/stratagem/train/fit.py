"""fit, evaluate and predict: Keras's training loop, written once for every stratagem strategy.

``data`` yields *global* batches ``(x, y)`` or ``(x, y, sample_weight)`` (a stratagem Dataset, a
torch DataLoader, a list); the strategy splits each across its replicas (a stratagem Dataset
ending in ``batch(B)`` is rebatched and auto-sharded, so each replica's pipeline reads only its
share). The model and optimizer must have been created in ``strategy.scope()``; fit runs under
the strategy that created them (``strategy=`` may name it; a different one is an error). ``fit`` minimizes the mean per-example loss over
each global batch (see ``stratagem.train.losses`` for how loss functions are read), so training
on N replicas gives the parameters one device gives on the same global batches.

Logs (the loss and metrics handed to callbacks, shown by the progress bar, kept in the History)
are global: every replica's totals are summed after each execution in one small collective, so they
are identical on all replicas and callbacks decide alike everywhere. ``stop_training`` (Keras's
``self.model.stop_training = True`` in a callback, or ``self.state.stop_training``) ends training
after the current batch when a batch hook sets it, else after the current epoch, as in Keras;
replicas agree on it, so all stop at the same batch even if only one replica's callback asked.

Keras's array form for ``evaluate`` and ``predict``: ``predict(model, x, batch_size=32)`` on a
tensor or numpy array (or a dict of them) reads it in batches of ``batch_size`` and concatenates
the outputs; ``evaluate(model, loss, (x, y), batch_size=32)`` likewise. ``evaluate`` returns what
Keras's does: the loss alone when there are no metrics, else ``[loss, *metrics]`` in the order
given, and the dict with ``return_dict=True``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Union, overload

import numpy as np
import torch
from torch import nn

from stratagem.core.batches import concat
from stratagem.distribute import context, current, ownership
from stratagem.distribute.mixed_precision import Policy
from stratagem.distribute.strategy import Strategy
from stratagem.train import loss_names
from stratagem.train.callback import Callback, CallbackList, Logs
from stratagem.train.history import History
from stratagem.train.inputs import check_finite, check_iterable
from stratagem.train.loop import (  # noqa: F401  (the cadence's names, read here as before they moved)
    AUTO_MAX_STEPS_PER_EXECUTION,
    AUTO_SYNC_SHARE,
    _batches,
    _Cadence,
    _run_test,
)
from stratagem.train.losses import LossFn, check_loss_fn
from stratagem.train.metrics import FitMetric, Mean, Metric, compile_metrics
from stratagem.train.overrides import StepLogs, keras_order, overridden
from stratagem.train.runners import FitRun, runner_for
from stratagem.train.steps import TrainOptions

if TYPE_CHECKING:
    from stratagem.pipeline.pipe import Pipe

__all__ = ["evaluate", "fit", "predict"]

#: A model: an nn.Module, or under PipelineStrategy also the Pipe from ``strategy.pipeline``.
Model = Union[nn.Module, "Pipe"]


def _strategy(
    model: Model, optimizer: torch.optim.Optimizer | None, given: Strategy | None, what: str
) -> Strategy:
    """The strategy that created ``model`` (and ``optimizer``); ``given`` or an open scope must
    agree with it. Without either, the open scope's strategy or the default one."""
    open_scope = current.get_strategy() if current.has_strategy() else None
    objects = {"the model": model, "the optimizer": optimizer}
    chosen = ownership.resolve(objects, given, open_scope, what)
    return chosen if chosen is not None else current.get_strategy()


def _tracked_metrics(model: Any, loss_fn: Any, metrics: Any, weighted_metrics: Any) -> list[Metric]:
    """What fit / evaluate log beside the loss, in Keras's order: the compiled metrics
    (``metrics=`` unweighted, then ``weighted_metrics=`` weighted), then each output's loss when
    the loss has several outputs (Keras's ``{output}_loss``)."""
    names = getattr(model, "output_names", None)
    out: list[Metric] = list(compile_metrics(metrics, weighted_metrics, names if isinstance(names, (list, tuple)) else None))
    output_metrics = getattr(type(loss_fn), "output_metrics", None)
    if output_metrics is not None:
        out += list(output_metrics(loss_fn, names if isinstance(names, (list, tuple)) else None))
    return out


def _in_keras_order(logs: Logs, tracked: Sequence[Metric]) -> list[float]:
    """Keras's ``evaluate`` list: the loss, then each metric found in the logs under its own
    name (a compiled metric's own ``name``, which a per-output or renamed metric's log key is
    not), then every other log in sorted order (Keras's ``_flatten_metrics_in_order``)."""
    names = ["loss", *((m.metric.name if isinstance(m, FitMetric) else m.name) for m in tracked[1:])]
    values = [logs[n] for n in names if n in logs]
    values += [logs[k] for k in sorted(logs) if k not in names]
    return values


def _check_scheduler(scheduler: Any, interval: str, strategy: Strategy, optimizer: torch.optim.Optimizer) -> None:
    if interval not in ("step", "epoch"):
        raise ValueError(f"lr_scheduler_interval must be 'step' (after every optimizer update) or 'epoch', got {interval!r}")
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "lr_scheduler=torch's ReduceLROnPlateau needs a monitored value: use "
            "callbacks=[stratagem.callbacks.ReduceLROnPlateau(monitor='val_loss', ...)] (Keras's)"
        )
    if not hasattr(scheduler, "step") or getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError(
            "lr_scheduler must be a torch.optim.lr_scheduler.LRScheduler over the optimizer fit steps; "
            f"got {type(scheduler).__name__}" + (" over another optimizer" if hasattr(scheduler, "step") else "")
        )


def fit(
    model: Model,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn | None,
    data: Iterable[Any],
    *,
    epochs: int = 1,
    validation_data: Iterable[Any] | None = None,
    metrics: Any = (),
    weighted_metrics: Any = (),
    callbacks: Sequence[Callback] = (),
    steps_per_epoch: int | None = None,
    strategy: Strategy | None = None,
    verbose: int | str = "auto",
    steps_per_execution: int | str = "auto",
    precision: str | Policy | None = None,
    initial_epoch: int = 0,
    validation_steps: int | None = None,
    class_weight: dict[int, float] | None = None,
    gradient_accumulation_steps: int = 1,
    clipnorm: float | None = None,
    clipvalue: float | None = None,
    global_clipnorm: float | None = None,
    lr_scheduler: Any = None,
    lr_scheduler_interval: str = "epoch",
    jit_compile: bool | str = "auto",
) -> History:
    """Train ``model`` for ``epochs`` epochs over ``data``; returns the History of global logs.

    ``strategy=None`` uses the strategy that created ``model`` (else the open scope's, else the
    default). Call it on every replica (every process of the job), with the same arguments.

    ``steps_per_execution`` (Keras's name): the loss and metric totals stay on the device and
    are summed across replicas and read back every that many steps and at the end of each
    epoch; the progress bar, History and ``on_train_batch_end`` see logs at those points (as in
    Keras). ``"auto"``: 1 when a callback acts per batch (``on_train_batch_begin/end``), else
    measured so that an execution's fixed cost (the sync among it) adds under 1% to the
    time of its steps (at most 128 steps). ``precision``: ``"32"`` (default), ``"bf16"``, ``"fp16"``
    (autocast; fp16 adds a loss scaler whose skipped steps are the same on every replica) or a
    ``stratagem.mixed_precision.Policy``.

    Keras's options: ``loss_fn`` may be a Keras name (``"mse"``, ``"sparse_categorical_crossentropy"``,
    ...; see ``stratagem.train.loss_names``: as in Keras the cross-entropies take probabilities,
    ``sg.losses.SparseCategoricalCrossentropy(from_logits=True)`` or ``nn.CrossEntropyLoss()``
    take logits) or a Keras ``sg.losses.Loss`` (called ``(y_true, y_pred)``; a torch loss is
    called ``(outputs, y)``), metrics too (``"accuracy"``
    picks binary/categorical/sparse by shapes); ``initial_epoch``; ``validation_steps``;
    ``class_weight`` ({class id: weight}, multiplied into the per-example weights);
    ``gradient_accumulation_steps=k`` (one optimizer update, and one gradient all-reduce, per k
    batches, equal to one step on the k-times larger batch); ``clipnorm`` (each gradient's norm),
    ``clipvalue``, ``global_clipnorm`` applied to the reduced gradients, alike on every replica;
    ``jit_compile=True``: the forward pass and the loss compiled once with ``stratagem.function``
    (``torch.compile``; a partial last batch recompiles once, into a dynamic batch dimension;
    the backward pass is compiled with them; collectives and the update run eagerly); ``"auto"``
    and ``False`` run eagerly.

    Metrics as Keras's ``compile`` takes them (``stratagem.train.metrics.compile_metrics``):
    ``metrics=`` are updated *without* sample weights or class weights, ``weighted_metrics=``
    with them; a metric given by name logs under that name; a dict ``{output: [metrics]}`` or a
    list of lists gives metrics per output of a model with several (logged
    ``"{output}_{name}"``). A Keras-style ``Metric`` subclass (``add_weight`` / ``update_state``
    / ``result``) works as is, its variables summed across replicas.

    ``lr_scheduler``: a torch ``LRScheduler`` over ``optimizer``, stepped after every optimizer
    update with ``lr_scheduler_interval="step"`` (Lightning's ``interval``; nanoGPT's warmup +
    cosine per iteration), or after each epoch's ``on_epoch_end`` with ``"epoch"`` (the default,
    as Lightning's).

    Models as Hugging Face writes them (``stratagem.train.outputs``): an ``x`` that is a mapping is
    passed as keyword arguments when ``forward`` takes its keys; a model returning a mapping (a
    ``ModelOutput``) hands its ``"logits"`` to ``loss_fn`` and the metrics, and ``loss_fn=None``
    minimizes the model's own ``"loss"`` (batches may then be ``x`` alone).
    """
    strategy = _strategy(model, optimizer, strategy, "fit")
    policy = Policy.of(precision)
    loss_fn = loss_names.resolve(loss_fn)
    if jit_compile not in (True, False, "auto"):
        raise ValueError(f"jit_compile must be True, False or 'auto', got {jit_compile!r}")
    options = TrainOptions(gradient_accumulation_steps, clipnorm, clipvalue, global_clipnorm,
                           dict(class_weight) if class_weight is not None else None,
                           jit_compile=jit_compile is True)
    _check_fit(strategy, optimizer, loss_fn, epochs, initial_epoch, lr_scheduler, lr_scheduler_interval)
    _check_optimizer_over(model, optimizer, strategy)
    runner = runner_for(strategy)  # how this strategy runs steps: its limits, its steps, its loop
    train_metrics = _tracked_metrics(model, loss_fn, metrics, weighted_metrics)
    runner.check_metrics(weighted_metrics)
    validation = validation_data is not None
    tracked = _tracked(model, "train_step", train_metrics)
    val_tracked = _tracked(model, "test_step", [copy.deepcopy(m) for m in train_metrics]) if validation else []
    if validation:
        check_iterable(validation_data, "validation_data")
        check_finite(validation_data, validation_steps, "validation_data", "validation_steps")
    params = {"epochs": epochs, "verbose": verbose, "do_validation": validation,
              "metrics": _log_names(tracked, validation), "num_replicas": strategy.num_replicas_in_sync}
    return runner.fit(FitRun(
        model, optimizer, loss_fn, data, policy, options, epochs, initial_epoch, steps_per_epoch,
        validation_data, validation_steps, tracked, val_tracked, params, callbacks, verbose,
        steps_per_execution, lr_scheduler, lr_scheduler_interval,
    ))  # fmt: skip


def _tracked(model: Any, step: str, metrics: list[Metric]) -> list[Metric]:
    """What a pass tracks: the loss and the metrics, or the logs of the model's own ``step``
    (Keras's ``train_step`` / ``test_step`` override)."""
    if overridden(model, step):
        return [StepLogs(model, f"{type(model).__name__}.{step}")]
    return [Mean("loss"), *metrics]


def on_batch(model: Model, optimizer: torch.optim.Optimizer | None, loss_fn: Any, batch: Any, what: str, *,
             metrics: Any = (), weighted_metrics: Any = (), class_weight: dict[int, float] | None = None,
             ) -> tuple[Any, list[Metric]]:
    """Keras's ``train_on_batch`` / ``test_on_batch`` / ``predict_on_batch``: one global batch
    through the model's steps (split across the replicas as fit splits it). ``what`` is
    ``"train"``, ``"test"`` or ``"predict"``. Returns the logs (the outputs for ``"predict"``) and
    the metrics tracked."""
    strategy = _strategy(model, optimizer, None, f"{what}_on_batch")
    resolved = loss_names.resolve(loss_fn)
    runner = runner_for(strategy)
    if what == "predict":
        steps = runner.steps(model, None, None)
        was = steps.module.training
        steps.set_training(False)
        try:
            with context.strategy_scope(strategy):
                return concat([steps.predict(b) for b in _batches(strategy, [batch], None)]), []
        finally:
            steps.set_training(was)
            steps.close()
    step = "train_step" if what == "train" else "test_step"
    tracked = _tracked(model, step, _tracked_metrics(model, resolved, metrics, weighted_metrics))
    options = TrainOptions(class_weight=dict(class_weight) if class_weight is not None else None)
    steps = runner.steps(model, optimizer if what == "train" else None, resolved, Policy.of(None), options)
    was = steps.module.training
    steps.set_training(what == "train")
    try:
        with context.strategy_scope(strategy):
            group = list(_batches(strategy, [batch], None))
            if what == "train":
                steps.train(group, tracked[0], tracked[1:])
            else:
                for b in group:
                    steps.test(b, tracked[0], tracked[1:])
    finally:
        steps.set_training(was)
        steps.close()
    from stratagem.train.loop import _logs
    from stratagem.train.metrics import sync_metrics

    sync_metrics(strategy, tracked)
    return _logs(tracked), tracked


def _check_fit(
    strategy: Strategy, optimizer: Any, loss_fn: Any, epochs: int, initial_epoch: int, lr_scheduler: Any, interval: str
) -> None:
    if initial_epoch < 0:
        raise ValueError(f"initial_epoch must be >= 0, got {initial_epoch}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    if loss_fn is not None:
        check_loss_fn(loss_fn)
    _check_scheduler(lr_scheduler, interval, strategy, optimizer)


def _check_optimizer_over(model: Any, optimizer: Any, strategy: Strategy) -> None:
    """An optimizer made over another model's parameters (a second ``model = ...`` after the
    optimizer was made, a copy) would update none of this model's weights: fit would train
    nothing without a word. (Strategies that place parameters elsewhere are left out.)"""
    # Only where the strategy trains the model's own parameter objects: ShardedStrategy and
    # ModelParallelStrategy swap them for shards when fit starts (and re-point the optimizer), the
    # parameter server and the pipeline keep them elsewhere, TPUStrategy may move them.
    own = ("DefaultStrategy", "OneDeviceStrategy", "MirroredStrategy", "MultiWorkerMirroredStrategy")
    if type(strategy).__name__ not in own or not isinstance(model, nn.Module):
        return
    mine = {id(p) for p in model.parameters() if p.requires_grad}
    theirs = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if mine and theirs and not mine & theirs:
        raise ValueError(
            f"the optimizer updates none of the model's parameters ({len(theirs)} tensors, none of "
            f"the model's {len(mine)}): it was made over another model's parameters; make it over "
            "this one's (torch.optim.SGD(model.parameters(), ...)) after the model"
        )


def _log_names(tracked: Sequence[Metric], validation: bool) -> list[str]:
    if isinstance(tracked[0], StepLogs):
        return []  # the names the model's own step returns, known once it ran
    names = [m.name for m in tracked]
    return names + ([f"val_{n}" for n in names] if validation else [])


#: Keras's default ``batch_size`` for array inputs.
DEFAULT_BATCH_SIZE = 32


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def _is_array_input(value: Any) -> bool:
    """A tensor or numpy array, or a non-empty mapping of them (named inputs)."""
    if _is_array(value):
        return True
    return isinstance(value, Mapping) and bool(value) and all(_is_array(v) for v in value.values())


def _as_tensor(value: Any) -> Any:
    """A numpy array as a tensor, floats as float32 (Keras's floatx); tensors as given."""
    if isinstance(value, Mapping):
        return {k: _as_tensor(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(value))
        return t.float() if t.is_floating_point() else t
    return value


def _rows_of(value: Any) -> int:
    leaves = list(value.values()) if isinstance(value, Mapping) else [value]
    sizes = {int(v.shape[0]) if v.dim() else -1 for v in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(
            f"the arrays of an input must have the same leading (batch) dimension; got shapes "
            f"{[tuple(v.shape) for v in leaves]}"
        )
    return sizes.pop()


def _slice(value: Any, a: int, b: int) -> Any:
    if isinstance(value, Mapping):
        return {k: v[a:b] for k, v in value.items()}
    return value[a:b]


def _array_batches(data: Any, batch_size: int | None, what: str, *, with_y: bool) -> Any:
    """Keras's array form: ``data`` (``x``, or a tuple ``(x, y)`` / ``(x, y, sample_weight)`` of
    tensors or numpy arrays) as a list of global batches of ``batch_size`` rows (32 when None),
    the last one partial; any other ``data`` as it is (it already yields batches)."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    parts: tuple[Any, ...] | None = None
    if _is_array_input(data):
        if with_y:
            raise ValueError(
                f"{what} got one array ({_describe(data)}) but needs labels: pass (x, y) (Keras's "
                f"{what}(x, y, batch_size=...)), or a dataset yielding (x, y) batches"
            )
        parts = (data,)
    elif isinstance(data, tuple) and not hasattr(data, "_fields") and len(data) in ((2, 3) if with_y else (1,)):
        if all(_is_array_input(v) for v in data):
            parts = data
    if parts is None:
        if batch_size is not None:
            raise ValueError(
                f"{what}: batch_size is for array inputs (a tensor or numpy array, or a tuple (x, y) "
                f"of them); this data ({type(data).__name__}) already yields batches, so leave "
                "batch_size unset (as Keras requires for a dataset)"
            )
        return data
    tensors = [_as_tensor(p) for p in parts]
    rows = {_rows_of(t) for t in tensors}
    if len(rows) != 1:
        raise ValueError(f"{what}: x, y (and sample_weight) must have the same number of rows; got {sorted(rows)}")
    n, size = rows.pop(), batch_size or DEFAULT_BATCH_SIZE
    return [tuple(_slice(t, a, min(a + size, n)) for t in tensors) for a in range(0, n, size)]


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: shape {tuple(v.shape)}" for k, v in value.items()) + "}"
    return f"shape {tuple(value.shape)}"


@overload
def evaluate(
    model: Model, loss_fn: LossFn | str | None, data: Iterable[Any] | Any, *, metrics: Any = ...,
    weighted_metrics: Any = ..., batch_size: int | None = ..., steps: int | None = ...,
    strategy: Strategy | None = ..., return_dict: Literal[False] = ...,
) -> Any: ...  # a float (the loss alone) or [loss, *metrics]


@overload
def evaluate(
    model: Model, loss_fn: LossFn | str | None, data: Iterable[Any] | Any, *, metrics: Any = ...,
    weighted_metrics: Any = ..., batch_size: int | None = ..., steps: int | None = ...,
    strategy: Strategy | None = ..., return_dict: Literal[True],
) -> dict[str, float]: ...


def evaluate(
    model: Model,
    loss_fn: LossFn | str | None,
    data: Iterable[Any] | Any,
    *,
    metrics: Any = (),
    weighted_metrics: Any = (),
    batch_size: int | None = None,
    steps: int | None = None,
    strategy: Strategy | None = None,
    return_dict: bool = False,
) -> Any:
    """The mean loss and the metrics of ``model`` over ``data`` (global values, on every replica),
    as Keras's ``evaluate`` returns them: the loss (a float) when there are no metrics, else the
    list ``[loss, *metrics]`` in Keras's order (the metrics as given, unweighted then weighted;
    per-output ones, logged under another name, after them in sorted order), so
    ``loss, acc = evaluate(...)`` works, and the dict ``{"loss": ..., name: ...}`` with
    ``return_dict=True``. ``metrics=`` ignore the batches' sample weights and
    ``weighted_metrics=`` use them, as in Keras (see ``fit``).

    ``data`` yields global batches ``(x, y)`` or ``(x, y, sample_weight)``, or is Keras's array
    form: a tuple ``(x, y)`` / ``(x, y, sample_weight)`` of tensors or numpy arrays, read in
    batches of ``batch_size`` (32 when None; numpy floats as float32). ``steps`` limits the number
    of batches read (needed for an infinite dataset)."""
    logs, values = evaluate_logs(model, loss_fn, data, metrics=metrics, weighted_metrics=weighted_metrics,
                                 batch_size=batch_size, steps=steps, strategy=strategy)
    if return_dict:
        return logs
    return values[0] if len(values) == 1 else values


def _callback_list(model: Any, strategy: Strategy, callbacks: Sequence[Callback]) -> CallbackList | None:
    """Keras's callbacks for evaluate / predict (their test / predict hooks), or None without any."""
    if not callbacks:
        return None
    from stratagem.train.callback import FitState

    state = FitState(model, None, strategy, History({}), {}, is_chief=bool(strategy.extended.should_log))
    return CallbackList(list(callbacks), state)


def evaluate_logs(
    model: Model, loss_fn: LossFn | str | None, data: Iterable[Any] | Any, *, metrics: Any = (),
    weighted_metrics: Any = (), batch_size: int | None = None, steps: int | None = None,
    strategy: Strategy | None = None, callbacks: Sequence[Callback] = (),
) -> tuple[Logs, list[float]]:
    """``evaluate``'s logs, and its values in Keras's order (``Model.evaluate`` uses both)."""
    strategy = _strategy(model, None, strategy, "evaluate")
    resolved: LossFn | None = loss_names.resolve(loss_fn)
    if resolved is not None:
        check_loss_fn(resolved)
    data = _array_batches(data, batch_size, "evaluate", with_y=resolved is not None)
    check_iterable(data, "data")
    check_finite(data, steps, "data", "steps")
    tracked = _tracked(model, "test_step", _tracked_metrics(model, resolved, metrics, weighted_metrics))
    runner = runner_for(strategy)
    runner.check_metrics(weighted_metrics)
    test_steps = runner.steps(model, None, resolved)
    was_training = test_steps.module.training
    test_steps.set_training(False)
    try:
        with context.strategy_scope(strategy):
            logs = _run_test(strategy, test_steps, data, tracked, _callback_list(model, strategy, callbacks), steps)
    finally:
        test_steps.set_training(was_training)
        test_steps.close()
    if isinstance(tracked[0], StepLogs):
        return logs, keras_order(model, logs)
    return logs, _in_keras_order(logs, tracked)


def predict(
    model: Model,
    data: Iterable[Any] | Any,
    *,
    batch_size: int | None = None,
    steps: int | None = None,
    strategy: Strategy | None = None,
    callbacks: Sequence[Callback] = (),
) -> Any:
    """The model's outputs for every example of ``data``, in input order, on every replica.

    ``data`` is Keras's ``x``: a tensor or numpy array (or a dict of them, named inputs), read in
    batches of ``batch_size`` rows (32 when None, as Keras; numpy floats as float32), so
    ``predict(model, x)`` on ``[32, 20]`` inputs gives ``[32, classes]``; or something that yields
    global batches ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)`` (a Dataset, a
    DataLoader, a list of batches; then leave ``batch_size`` unset). Outputs are concatenated
    along the batch dimension (nested outputs leaf by leaf), as tensors. Returns None when
    ``data`` is empty. ``steps`` limits the number of batches read.
    """
    strategy = _strategy(model, None, strategy, "predict")
    data = _array_batches(data, batch_size, "predict", with_y=False)
    check_iterable(data, "data")
    check_finite(data, steps, "data", "steps")
    predict_steps = runner_for(strategy).steps(model, None, None)
    was_training = predict_steps.module.training
    predict_steps.set_training(False)
    parts: list[Any] = []
    cblist = _callback_list(model, strategy, callbacks)
    try:
        with context.strategy_scope(strategy):
            if cblist is not None:
                cblist.call("on_predict_begin", None)
            for i, batch in enumerate(_batches(strategy, data, steps)):
                if cblist is not None:
                    cblist.call("on_predict_batch_begin", i, None)
                parts.append(predict_steps.predict(batch))
                if cblist is not None:
                    cblist.call("on_predict_batch_end", i, {"outputs": parts[-1]})
            if cblist is not None:
                cblist.call("on_predict_end", None)
    finally:
        predict_steps.set_training(was_training)
        predict_steps.close()
    return concat(parts)
