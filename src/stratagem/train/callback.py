"""The Callback base class (Keras's hooks), the FitState a callback sees, and CallbackList.

A callback is told about training through Keras's hooks, each receiving ``logs``: a dict of
*global* values (loss and metrics summed over every replica), identical on every replica. It
sees the run through ``self.state`` (a FitState): the model, optimizer, strategy, epoch and step.

Stopping, as in Keras: ``self.model.stop_training = True`` (or ``self.state.stop_training =
True``) in any hook ends training after the current batch when set in a batch hook, else after
the current epoch (its validation and ``on_epoch_end`` still run). fit agrees on it across
replicas, so every replica stops at the same batch even if only one asked. Hooks run on every
replica; a callback that writes files writes only where ``self.is_chief`` (the replica that
checkpoints). ``on_batch_begin``/``on_batch_end`` are Keras's aliases of
``on_train_batch_begin``/``on_train_batch_end``: the train-batch hooks call them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from stratagem.distribute.strategy import Strategy
    from stratagem.train.history import History

Logs = dict[str, float]


@dataclass
class FitState:
    """What a callback can see of (and change in) the run in progress."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    strategy: Strategy
    history: History
    #: ``fit``'s arguments and facts: epochs, steps (per epoch, or None if unknown), verbose,
    #: metrics (names), do_validation, num_replicas.
    params: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    #: Steps finished in the current epoch.
    step: int = 0
    #: Optimizer steps taken since training began (over all epochs, resumes included).
    iterations: int = 0
    #: Global examples trained on in the current epoch (for samples/s).
    samples: int = 0
    #: Set True (on any replica) to end training after the current batch (in a batch hook) or
    #: epoch; Keras's ``self.model.stop_training = True`` does the same.
    stop_training: bool = False
    #: Epoch and step to start from; set by a callback in ``on_train_begin`` to resume.
    initial_epoch: int = 0
    initial_step: int = 0
    #: Whether this process prints and writes shared files (logs, plots): replica 0 (under a
    #: pipeline, stage 0 of copy 0). Checkpoints are written by the CheckpointManager's rules.
    is_chief: bool = False
    #: Installed by fit for an exact resume (see BackupAndRestore): ``capture(progress,
    #: epoch_end=...)`` fills a FitProgress with the data position, metric totals, history and
    #: RNG states (collective: every replica calls it); ``restore(progress)`` puts them back.
    capture: Callable[..., None] | None = None
    restore: Callable[..., None] | None = None


class Callback:
    """Base class for fit/evaluate/predict callbacks: override the hooks you need."""

    #: Whether the batch hooks may set ``stop_training`` (then fit agrees on it after each batch
    #: on more than one replica, one small collective). Built-in callbacks that never do say False.
    may_stop_per_batch: bool = True

    def __init__(self) -> None:
        self._state: FitState | None = None

    def set_state(self, state: FitState) -> None:
        self._state = state

    @property
    def state(self) -> FitState:
        if self._state is None:
            raise RuntimeError(
                f"{type(self).__name__} is not attached to a run; pass it to stratagem.fit(..., "
                "callbacks=[...]) (state is set before on_train_begin)"
            )
        return self._state

    @property
    def model(self) -> nn.Module:
        return self.state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.state.optimizer

    @property
    def params(self) -> dict[str, Any]:
        return self.state.params

    @property
    def is_chief(self) -> bool:
        """Whether this replica writes shared files (checkpoints, logs)."""
        return self.state.is_chief

    # --- hooks (Keras names; the test hooks run for fit's validation) -------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None: ...
    def on_train_end(self, logs: Logs | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        """Keras's alias of ``on_train_batch_begin`` (which calls it)."""

    def on_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Keras's alias of ``on_train_batch_end`` (which calls it)."""

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        self.on_batch_begin(batch, logs=logs)  # as Keras: for backwards compatibility

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self.on_batch_end(batch, logs=logs)

    def on_test_begin(self, logs: Logs | None = None) -> None: ...
    def on_test_end(self, logs: Logs | None = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_begin(self, logs: Logs | None = None) -> None: ...
    def on_predict_end(self, logs: Logs | None = None) -> None: ...
    def on_predict_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...


class CallbackList:
    """Calls a hook on every callback in order."""

    def __init__(self, callbacks: Iterable[Callback], state: FitState) -> None:
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(
                    f"callbacks must be stratagem.callbacks.Callback instances; got "
                    f"{type(cb).__name__}"
                )
            cb.set_state(state)

    def call(self, hook: str, *args: Any) -> None:
        if args and args[-1] is None:  # Keras's CallbackList passes logs as {} when there are none
            args = (*args[:-1], {})
        for cb in self.callbacks:
            getattr(cb, hook)(*args)

    def __iter__(self) -> Any:
        return iter(self.callbacks)
