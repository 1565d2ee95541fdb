"""fit, evaluate and predict: Keras's training loop, written once for every stratagem strategy.

``data`` yields *global* batches ``(x, y)`` or ``(x, y, sample_weight)`` (a stratagem Dataset, a
torch DataLoader, a list); the strategy splits each across its replicas (a stratagem Dataset
ending in ``batch(B)`` is rebatched and auto-sharded, so each replica's pipeline reads only its
share). The model and optimizer must have been created in ``strategy.scope()``; fit runs under
the strategy that created them (``strategy=`` may name it; a different one is an error). ``fit`` minimizes the mean per-example loss over
each global batch (see ``stratagem.train.losses`` for how loss functions are read), so training
on N replicas gives the parameters one device gives on the same global batches.

Logs (the loss and metrics handed to callbacks, shown by the progress bar, kept in the History)
are global: every replica's totals are summed after each step in one small collective, so they
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
import itertools
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Union, overload

import numpy as np
import torch
from torch import nn

from stratagem.core.batches import concat
from stratagem.distribute import context, current, ownership
from stratagem.distribute.mixed_precision import Policy
from stratagem.distribute.strategy import Execution, Strategy
from stratagem.train import loss_names
from stratagem.train.callback import Callback, CallbackList, FitState, Logs
from stratagem.train.history import History
from stratagem.train.inputs import GlobalBatches, check_finite, check_iterable, distributed
from stratagem.train.losses import LossFn, check_loss_fn
from stratagem.train.metrics import FitMetric, Mean, Metric, compile_metrics, sync_metrics
from stratagem.train.progress import Progress, resolve_mode
from stratagem.train.resume import FitProgress
from stratagem.train.steps import DataParallelSteps, TrainOptions

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


def _make_steps(
    strategy: Strategy,
    model: Model,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: LossFn | None,
    policy: Policy | None = None,
    options: TrainOptions | None = None,
) -> Any:
    from stratagem.train.pipeline_steps import PipelineSteps

    policy = policy or Policy.of(None)
    options = options or TrainOptions()
    if strategy.extended.execution is Execution.PIPELINE:
        if policy.name != "32":
            raise ValueError(f"precision={policy.name!r} is not supported under PipelineStrategy yet; use precision='32'")
        if options.accumulate != 1 or options.class_weight is not None or options.jit_compile:
            raise ValueError(
                "gradient_accumulation_steps, class_weight and jit_compile are not supported under "
                "PipelineStrategy yet (its micro-batches already accumulate: raise num_microbatches "
                "and the batch size instead); leave them unset"
            )
        from stratagem.pipeline.pipe import Pipe

        if loss_fn is None and optimizer is not None and not isinstance(model, Pipe):
            raise ValueError(
                "loss_fn=None (the model's own loss) is not supported under PipelineStrategy: the "
                "last stage computes the loss from the model's output; pass a loss_fn"
            )
        return PipelineSteps(strategy, model, optimizer, loss_fn, options)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    return DataParallelSteps(strategy, model, optimizer, loss_fn, policy, options)


#: ``steps_per_execution="auto"``: the most steps between two reads of the logs, and the share of
#: the step time that an execution's fixed cost (``strategy.run``, the metric updates, the sync
#: and read-back of the logs) may add.
AUTO_MAX_STEPS_PER_EXECUTION = 128
AUTO_SYNC_SHARE = 0.01


_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")


def _acts_per_batch(cb: Callback) -> bool:
    if isinstance(cb, Progress):
        return False  # the progress bar is fine with a log per execution
    kind = type(cb)  # a hook set on the instance (LambdaCallback) counts too
    return any(getattr(kind, hook) is not getattr(Callback, hook) or hook in getattr(cb, "__dict__", {}) for hook in _BATCH_HOOKS)


def _may_stop_per_batch(cb: Callback) -> bool:
    """Whether ``cb``'s batch hooks may set ``stop_training`` (fit then agrees after each batch)."""
    return _acts_per_batch(cb) and bool(getattr(cb, "may_stop_per_batch", True))


def _stop_asked(state: FitState) -> bool:
    """Whether this replica's callbacks asked to stop: ``state.stop_training`` or Keras's
    ``self.model.stop_training``."""
    return bool(state.stop_training) or bool(getattr(state.model, "stop_training", False))


def _set_model_flag(model: Any, value: bool) -> None:
    """Keras's ``model.stop_training`` (False when fit starts, True once it stopped early)."""
    try:
        model.stop_training = value
    except (AttributeError, TypeError):  # an object that takes no attributes: state.stop_training only
        pass


class _Cadence:
    """How many steps each execution runs. A number is used as given; ``"auto"`` is 1 while a
    callback acts per batch, else measured: the first two executions run one step each, timing
    the step (inside ``strategy.run``) and the execution's fixed cost around it; at the second
    sync every replica proposes the smallest count that keeps the fixed cost under
    ``AUTO_SYNC_SHARE`` of the steps' time (at most ``AUTO_MAX_STEPS_PER_EXECUTION``), and all
    use the mean of the proposals (summed in the sync they already do, so they agree). So a
    step of a few milliseconds or more keeps a log per step, as in Keras."""

    def __init__(self, value: int | str, callbacks: Sequence[Callback]) -> None:
        if value == "auto":
            self.size = 1
            self.measuring = not any(_acts_per_batch(cb) for cb in callbacks)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"steps_per_execution must be a positive number of steps or 'auto', got {value!r}")
        else:
            self.size, self.measuring = value, False
        self.step_times: list[float] = []  # seconds per step
        self.fixed_times: list[float] = []  # seconds of an execution outside its steps

    def timed(self, steps: int, seconds: float, in_steps: float | None, sync: float) -> None:
        """One execution of ``steps`` steps took ``seconds`` to train (``in_steps`` of them in the
        steps themselves, when known) and ``sync`` to sync."""
        inner = seconds if in_steps is None else min(in_steps, seconds)
        self.step_times.append(inner / steps)
        self.fixed_times.append(seconds - inner + sync)

    def proposal(self, seconds: float, in_steps: float | None, steps: int) -> list[float]:
        """What this replica adds to the sync of an execution that trained ``steps`` steps in
        ``seconds`` (``in_steps`` in the steps): nothing, or its proposed count."""
        if not self.measuring or not self.fixed_times:
            return []
        inner = seconds if in_steps is None else min(in_steps, seconds)
        step = min(*self.step_times, inner / steps)
        fixed = min(self.fixed_times)
        want = math.ceil(fixed / max(AUTO_SYNC_SHARE * step, 1e-9))
        return [float(min(max(want, 1), AUTO_MAX_STEPS_PER_EXECUTION))]

    def agreed(self, total: list[float], replicas: int) -> None:
        if total:
            self.size = max(1, min(AUTO_MAX_STEPS_PER_EXECUTION, math.ceil(total[0] / replicas - 1e-9)))
            self.measuring = False


def _end_execution(
    strategy: Strategy, tracked: Sequence[Metric], state: FitState, cblist: CallbackList, extra: list[float]
) -> list[float]:
    """The end of an execution: one collective for every total, then the batch-end logs."""
    summed = sync_metrics(strategy, tracked, extra)
    state.samples = int(tracked[0].global_totals()[1])
    cblist.call("on_train_batch_end", state.step - 1, _logs(tracked))
    return summed


def _batches(strategy: Strategy, data: Iterable[Any], steps: int | None) -> Iterable[Any]:
    batches = distributed(strategy, data)
    return batches if steps is None else itertools.islice(batches, steps)


def _logs(metrics: Sequence[Metric], prefix: str = "") -> Logs:
    logs: Logs = {}
    for m in metrics:
        value = m.result()
        if isinstance(value, Mapping):  # a metric whose result is a dict logs each entry (Keras)
            logs.update({prefix + str(k): float(v) for k, v in value.items()})
        else:
            logs[prefix + m.name] = float(value)
    return dict(sorted(logs.items()))  # Keras 3's logs come in sorted order (its history, its bar)


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


def _reset(metrics: Sequence[Metric]) -> None:
    for m in metrics:
        m.reset_state()


def _run_test(
    strategy: Strategy,
    runner: Any,
    data: Iterable[Any],
    tracked: Sequence[Metric],
    cblist: CallbackList | None,
    steps: int | None = None,
) -> Logs:
    _reset(tracked)
    if cblist is not None:
        cblist.call("on_test_begin", None)
    logs: Logs = {}
    for i, batch in enumerate(_batches(strategy, data, steps)):
        if cblist is not None:
            cblist.call("on_test_batch_begin", i, None)
        runner.test(batch, tracked[0], tracked[1:])
        if cblist is not None:
            sync_metrics(strategy, tracked)
            cblist.call("on_test_batch_end", i, _logs(tracked))
    sync_metrics(strategy, tracked)
    logs = _logs(tracked)
    if cblist is not None:
        cblist.call("on_test_end", logs)
    return logs


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
    train_metrics = _tracked_metrics(model, loss_fn, metrics, weighted_metrics)
    if weighted_metrics and strategy.extended.execution is Execution.PIPELINE:
        raise ValueError(
            "weighted_metrics is not supported under PipelineStrategy yet (its steps pass no sample weights "
            "to metrics); give the metrics in metrics= (unweighted, as Keras's)"
        )
    tracked = [Mean("loss"), *train_metrics]
    val_tracked = [Mean("loss"), *(copy.deepcopy(m) for m in train_metrics)] if validation_data is not None else []
    if validation_data is not None:
        check_iterable(validation_data, "validation_data")
        check_finite(validation_data, validation_steps, "validation_data", "validation_steps")
    params = {"epochs": epochs, "verbose": verbose, "do_validation": validation_data is not None,
              "metrics": _log_names(tracked, validation_data is not None), "num_replicas": strategy.num_replicas_in_sync}
    if strategy.extended.execution is Execution.COORDINATED:  # ParameterServerStrategy: steps scheduled onto workers
        from stratagem.train import coordinated_fit

        coordinated_fit.unsupported({
            "precision": policy.name != "32", "gradient_accumulation_steps": gradient_accumulation_steps != 1,
            "clipnorm": clipnorm, "clipvalue": clipvalue, "global_clipnorm": global_clipnorm,
            "class_weight": class_weight, "lr_scheduler": lr_scheduler,
        })  # fmt: skip

        def validate() -> Logs:
            runner = _make_steps(strategy, model, None, loss_fn)
            return _run_test(strategy, runner, validation_data, val_tracked, None, validation_steps)  # type: ignore[arg-type]

        assert isinstance(model, nn.Module)  # a Pipe exists only under PipelineStrategy
        return coordinated_fit.fit_coordinated(
            strategy, model, optimizer, loss_fn, data, epochs=epochs, steps_per_epoch=steps_per_epoch,
            tracked=tracked, callbacks=callbacks, verbose=verbose, initial_epoch=initial_epoch,
            validate=validate if validation_data is not None else None, params=params,
        )  # fmt: skip
    steps = _make_steps(strategy, model, optimizer, loss_fn, policy, options)
    if lr_scheduler is not None and lr_scheduler_interval == "step":
        steps.after_update = lr_scheduler.step
    batches = GlobalBatches(strategy, data, steps_per_epoch)
    loop = _Loop(strategy, steps, optimizer, batches, tracked, val_tracked, {**params, "steps": batches.steps()},
                 callbacks, verbose, steps_per_execution, options.accumulate)
    loop.validation = (validation_data, validation_steps) if validation_data is not None else None
    loop.epoch_scheduler = lr_scheduler if lr_scheduler_interval == "epoch" else None
    return loop.run(initial_epoch, epochs)


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


def _log_names(tracked: Sequence[Metric], validation: bool) -> list[str]:
    names = [m.name for m in tracked]
    return names + ([f"val_{n}" for n in names] if validation else [])


class _Loop:
    """fit's epochs when the replicas step together (every strategy but ParameterServerStrategy):
    executions of up to ``steps_per_execution`` steps, each ended by one sync of the logs, then
    validation, the callbacks and the stop agreed by every replica."""

    def __init__(
        self,
        strategy: Strategy,
        steps: Any,
        optimizer: torch.optim.Optimizer,
        batches: GlobalBatches,
        tracked: list[Metric],
        val_tracked: list[Metric],
        params: dict[str, Any],
        callbacks: Sequence[Callback],
        verbose: int | str,
        steps_per_execution: int | str,
        accumulate: int,
    ) -> None:
        self.strategy, self.steps, self.batches = strategy, steps, batches
        self.tracked, self.val_tracked = tracked, val_tracked
        self.accumulate = accumulate
        self.validation: tuple[Iterable[Any], int | None] | None = None
        self.epoch_scheduler: Any = None
        self.history = History(params)
        self.state = state = FitState(steps.module, optimizer, strategy, self.history, params, is_chief=steps.is_chief)
        cbs = list(callbacks)
        mode = resolve_mode(verbose)
        if mode is not None and not any(isinstance(cb, Progress) for cb in cbs):
            cbs.insert(0, Progress(mode))
        self.cblist = CallbackList(cbs, state)
        self.cadence = _Cadence(steps_per_execution, cbs)
        self.per_batch_stop = any(_may_stop_per_batch(cb) for cb in cbs)
        state.capture = self.capture
        state.restore = self.restore

    def capture(self, progress: FitProgress, *, epoch_end: bool) -> None:
        state = self.state
        progress.capture(
            epoch=state.epoch + 1 if epoch_end else state.epoch,
            step=0 if epoch_end else state.step,
            iterations=state.iterations,
            data=self.batches.state_dict(),
            metrics=self.tracked,
            history=self.history.state_dict(),
            loss_scale=self.steps.loss_scale_state(),
        )

    def restore(self, progress: FitProgress) -> None:
        saved, state = progress.state, self.state
        self.batches.load_state_dict(saved["data"])
        self.history.load_state_dict(saved["history"])
        if saved["step"] > 0:
            progress.restore_metrics(self.tracked)
        state.initial_epoch, state.initial_step = int(saved["epoch"]), int(saved["step"])
        state.iterations = int(saved["iterations"])
        pieces = getattr(self.steps, "pieces", None)
        if pieces is not None:  # the deterministic mode's dropout: by update, as the run that went on
            pieces.updates = state.iterations
        if saved.get("loss_scale") is not None:
            self.steps.load_loss_scale_state(saved["loss_scale"])

    def run(self, initial_epoch: int, epochs: int) -> History:
        state, cblist = self.state, self.cblist
        logs: Logs = {}
        _set_model_flag(state.model, False)  # as Keras: model.stop_training is reset by each fit
        with context.strategy_scope(self.strategy):
            cblist.call("on_train_begin", None)
            if state.initial_epoch == 0 and state.initial_step == 0:
                state.initial_epoch = initial_epoch  # a backup restored by on_train_begin wins
            for epoch in range(state.initial_epoch, epochs):
                logs = self._epoch(epoch)
                if self.steps.agree(_stop_asked(state)):
                    state.stop_training = True
                    _set_model_flag(state.model, True)
                    break
            cblist.call("on_train_end", dict(logs))
        return self.history

    def _epoch(self, epoch: int) -> Logs:
        state, steps, tracked = self.state, self.steps, self.tracked
        state.epoch = epoch
        if epoch == state.initial_epoch and state.initial_step > 0:
            state.step = state.initial_step  # resumed mid-epoch: data, metrics already restored
        else:
            state.step = 0
            _reset(tracked)
            self.batches.begin_epoch()
        sync_metrics(self.strategy, tracked)
        state.samples = int(tracked[0].global_totals()[1])
        steps.set_training(True)
        self.cblist.call("on_epoch_begin", epoch, None)
        self._train(self.batches.epoch())
        logs = _logs(tracked)
        if self.validation is not None:
            steps.set_training(False)
            val = _run_test(self.strategy, steps, self.validation[0], self.val_tracked, self.cblist, self.validation[1])
            logs.update({f"val_{k}": v for k, v in val.items()})
            steps.set_training(True)
        self.history.record(epoch, logs)
        self.cblist.call("on_epoch_end", epoch, logs)  # callbacks may add logs (learning_rate)
        self.history.update_last(logs)
        if self.epoch_scheduler is not None:
            self.epoch_scheduler.step()
        return logs

    def _train(self, epoch_batches: Iterator[Any]) -> None:
        """The epoch's executions: up to ``cadence.size`` steps in one ``strategy.run``, then one sync."""
        state, cadence, tracked = self.state, self.cadence, self.tracked
        while True:
            group = list(itertools.islice(epoch_batches, cadence.size * self.accumulate))
            if not group:
                return
            self.cblist.call("on_train_batch_begin", state.step, None)
            t0 = time.perf_counter()
            in_steps = self.steps.train(group, tracked[0], tracked[1:])
            t1 = time.perf_counter()
            state.step += len(group)
            state.iterations += len(group)
            # the sync also carries whether a callback asked to stop before this execution's
            # end (on_epoch_begin, on_train_batch_begin): every replica stops after this batch,
            # as Keras does, at no extra collective
            proposal = cadence.proposal(t1 - t0, in_steps, len(group))
            summed = _end_execution(self.strategy, tracked, state, self.cblist, [float(_stop_asked(state)), *proposal])
            if cadence.measuring:
                cadence.timed(len(group), t1 - t0, in_steps, time.perf_counter() - t1)
                cadence.agreed(summed[1:], self.strategy.num_replicas_in_sync)
            # asked in on_train_batch_end (Keras checks after each batch): agreed now, so every
            # replica stops after this batch (one small collective, only with such callbacks)
            if summed[0] > 0 or (self.per_batch_stop and self.steps.agree(_stop_asked(state))):
                state.stop_training = True
                _set_model_flag(state.model, True)
                return


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


def evaluate_logs(
    model: Model, loss_fn: LossFn | str | None, data: Iterable[Any] | Any, *, metrics: Any = (),
    weighted_metrics: Any = (), batch_size: int | None = None, steps: int | None = None,
    strategy: Strategy | None = None,
) -> tuple[Logs, list[float]]:
    """``evaluate``'s logs, and its values in Keras's order (``Model.evaluate`` uses both)."""
    strategy = _strategy(model, None, strategy, "evaluate")
    resolved: LossFn | None = loss_names.resolve(loss_fn)
    if resolved is not None:
        check_loss_fn(resolved)
    data = _array_batches(data, batch_size, "evaluate", with_y=resolved is not None)
    check_iterable(data, "data")
    check_finite(data, steps, "data", "steps")
    tracked = [Mean("loss"), *_tracked_metrics(model, resolved, metrics, weighted_metrics)]
    if weighted_metrics and strategy.extended.execution is Execution.PIPELINE:
        raise ValueError(
            "weighted_metrics is not supported under PipelineStrategy yet (its steps pass no sample weights "
            "to metrics); give the metrics in metrics= (unweighted, as Keras's)"
        )
    runner = _make_steps(strategy, model, None, resolved)
    was_training = runner.module.training
    runner.set_training(False)
    try:
        with context.strategy_scope(strategy):
            logs = _run_test(strategy, runner, data, tracked, None, steps)
    finally:
        runner.set_training(was_training)
    return logs, _in_keras_order(logs, tracked)


def predict(
    model: Model,
    data: Iterable[Any] | Any,
    *,
    batch_size: int | None = None,
    steps: int | None = None,
    strategy: Strategy | None = None,
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
    runner = _make_steps(strategy, model, None, None)
    was_training = runner.module.training
    runner.set_training(False)
    parts: list[Any] = []
    try:
        with context.strategy_scope(strategy):
            for batch in _batches(strategy, data, steps):
                parts.append(runner.predict(batch))
    finally:
        runner.set_training(was_training)
    return concat(parts)
