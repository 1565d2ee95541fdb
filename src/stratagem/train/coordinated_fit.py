"""fit under a strategy whose steps a coordinator schedules onto workers (ParameterServerStrategy).

As Keras under ``ParameterServerStrategy``: ``steps_per_epoch`` is required (workers read their
own copies of the data, repeated, so an epoch is a number of steps, not a pass), each step is a
function the ClusterCoordinator runs on the next free worker, and the loss and metrics are exact
over the steps that ran: every step returns its batch's metric totals, added once each on the
chief. Validation runs on the chief with the variables' current values (tf's inline evaluation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.core.sample_weights import weigh
from stratagem.distribute import context
from stratagem.distribute.coordinator import ClusterCoordinator
from stratagem.distribute.loss import compute_average_loss
from stratagem.distribute.strategy import Strategy
from stratagem.train.callback import Callback, CallbackList, FitState, Logs
from stratagem.train.history import History
from stratagem.train.losses import LossFn, per_example_loss
from stratagem.train.metrics import Metric
from stratagem.train.outputs import call_model, examples_in, model_loss, predictions
from stratagem.train.progress import Progress, resolve_mode
from stratagem.train.steps import unpack


class Repeated:
    """A worker's copy of ``data``, read pass after pass (a fresh ``iter`` each pass)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __call__(self, input_context: Any) -> Repeated:
        data = self.data
        if callable(data) and not hasattr(data, "__iter__"):  # a dataset_fn, built on the worker
            import inspect

            takes = len(inspect.signature(data).parameters) > 0
            return Repeated(data(input_context) if takes else data())
        return self

    def __iter__(self) -> Iterator[Any]:
        empty = 0
        while True:
            got = False
            for batch in self.data:
                got = True
                yield batch
            empty = 0 if got else empty + 1
            if empty:
                raise ValueError("fit's data yields no batch; a worker cannot read an epoch from it")


def train_step(
    iterator: Iterator[Any], strategy: Strategy, model: nn.Module, optimizer: Any, loss_fn: LossFn | None,
    metrics: Sequence[Metric],
) -> list[torch.Tensor]:
    """One step on a worker: the batch's loss and metric totals (their sums, exact to add)."""
    batch = next(iterator)

    def replica_fn() -> list[torch.Tensor]:
        x, y, sw = unpack(batch, need_y=loss_fn is not None)
        optimizer.zero_grad(set_to_none=True)
        outputs = call_model(model, x)
        preds = predictions(outputs)
        if loss_fn is None:
            losses = weigh(model_loss(outputs, examples_in(x)), sw)
        else:
            losses = per_example_loss(loss_fn, preds, y, sample_weight=sw).float()
        compute_average_loss(losses).backward()
        optimizer.step()
        totals = [metrics[0].batch_totals(losses.detach())]
        totals += [m.batch_totals(y, preds.detach(), sample_weight=sw) for m in metrics[1:]]
        return [t.detach().cpu() for t in totals]

    return strategy.run(replica_fn)  # type: ignore[no-any-return]


def fit_coordinated(
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn | None,
    data: Any,
    *,
    epochs: int,
    steps_per_epoch: int | None,
    tracked: list[Metric],
    callbacks: Sequence[Callback],
    verbose: int | str,
    initial_epoch: int,
    validate: Callable[[], Logs] | None,
    params: dict[str, Any],
) -> History:
    if steps_per_epoch is None or steps_per_epoch < 1:
        raise ValueError(
            f"fit under {type(strategy).__name__} needs steps_per_epoch (got {steps_per_epoch!r}), as "
            "Keras does: each worker reads its own copy of the data, repeated, so an epoch is a "
            "number of steps; pass steps_per_epoch=N"
        )
    from stratagem.train.callbacks import BackupAndRestore

    if any(isinstance(cb, BackupAndRestore) for cb in callbacks):
        raise ValueError(
            f"BackupAndRestore is not supported by fit under {type(strategy).__name__} yet: save with "
            "ModelCheckpoint or a CheckpointManager (variables and optimizer state are read from the "
            "ps tasks) and restore before fit"
        )
    coordinator = ClusterCoordinator(strategy)  # the strategy's one coordinator (the user's too)
    iterator = iter(coordinator.create_per_worker_dataset(Repeated(data)))
    params = dict(params, steps=steps_per_epoch)
    history = History(params)
    state = FitState(model, optimizer, strategy, history, params, is_chief=True)
    cbs = list(callbacks)
    mode = resolve_mode(verbose)
    if mode is not None and not any(isinstance(cb, Progress) for cb in cbs):
        cbs.insert(0, Progress(mode))
    cblist = CallbackList(cbs, state)
    logs: Logs = {}
    values: list[Any] = []  # this epoch's steps
    try:
        with context.strategy_scope(strategy):
            cblist.call("on_train_begin", None)
            for epoch in range(initial_epoch, epochs):
                state.epoch, state.step = epoch, 0
                for m in tracked:
                    m.reset_state()
                cblist.call("on_epoch_begin", epoch, None)
                values.clear()
                for _ in range(steps_per_epoch):
                    values.append(
                        coordinator.schedule(train_step, args=(iterator, strategy, model, optimizer, loss_fn, tracked))
                    )
                for value in values:  # in order, as they arrive: every step's totals added once
                    cblist.call("on_train_batch_begin", state.step, None)
                    for m, totals in zip(tracked, value.fetch()):
                        m.add_totals(totals)
                    state.step += 1
                    state.iterations += 1
                    cblist.call("on_train_batch_end", state.step - 1, _logs(tracked))
                coordinator.join()
                logs = _logs(tracked)
                if validate is not None:
                    logs.update({f"val_{k}": v for k, v in validate().items()})
                history.record(epoch, logs)
                cblist.call("on_epoch_end", epoch, logs)
                history.update_last(logs)
                if state.stop_training:
                    break
            cblist.call("on_train_end", dict(logs))
    except BaseException:
        # this fit's steps still queued are cancelled, those under way waited for, and its first
        # error forgotten: raised here, it is not raised again by a later schedule() or join()
        coordinator._abandon(values)
        raise
    return history


def _logs(tracked: Sequence[Metric]) -> Logs:
    """The logs, named and sorted as fit's (Keras's order)."""
    return dict(sorted((m.name, float(m.result())) for m in tracked))


def unsupported(options: dict[str, Any]) -> None:
    """fit's options that need a synchronous step (all replicas at once) are refused here."""
    given = [k for k, v in options.items() if v]
    if given:
        raise ValueError(
            f"fit under ParameterServerStrategy does not support {', '.join(given)} yet: each worker "
            "steps on its own; leave them unset"
        )

