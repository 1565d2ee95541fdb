"""ReduceLROnPlateau and TerminateOnNaN: Keras's callbacks that act on the global logs, alike everywhere.

Both decide from the logs fit hands every replica after its sync (global values, bitwise the
same on every replica), so every replica lowers the learning rate, or stops, at the same
epoch or step without a collective of their own. Messages are printed by the chief only.
"""

from __future__ import annotations

import math

from stratagem.core.warn import warn_user
from stratagem.train.callback import Callback, Logs

__all__ = ["ReduceLROnPlateau", "TerminateOnNaN"]


def _mode(mode: str, monitor: str) -> str:
    if mode not in ("auto", "min", "max"):
        warn_user(f"ReduceLROnPlateau mode {mode!r} is unknown, falling back to 'auto'", stacklevel=3)
        mode = "auto"
    if mode == "auto":  # Keras: a monitored accuracy is maximized, anything else minimized
        return "max" if "acc" in monitor else "min"
    return mode


class ReduceLROnPlateau(Callback):
    """Multiply the learning rate by ``factor`` when ``monitor`` stops improving (Keras semantics).

    After ``patience`` epochs without an improvement larger than ``min_delta``, every parameter
    group's rate becomes ``max(lr * factor, min_lr)`` (groups already at ``min_lr`` stay), then
    ``cooldown`` epochs pass before waiting starts again. The current rate is logged as
    ``learning_rate``. The monitored value is global, so every replica lowers alike.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        verbose: int = 0,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
        **kwargs: float,
    ) -> None:
        super().__init__()
        if "epsilon" in kwargs:  # Keras 2's old name for min_delta
            min_delta = kwargs.pop("epsilon")
        if kwargs:
            raise TypeError(f"ReduceLROnPlateau got unexpected arguments {sorted(kwargs)}")
        if factor >= 1.0:
            raise ValueError(
                f"ReduceLROnPlateau does not support a factor >= 1.0 (got {factor}); the rate is "
                "multiplied by factor on a plateau, so use e.g. factor=0.1"
            )
        self.monitor = monitor
        self.factor = float(factor)
        self.patience = patience
        self.verbose = verbose
        self.mode = _mode(mode, monitor)
        self.min_delta = abs(min_delta)
        self.cooldown = cooldown
        self.min_lr = float(min_lr)
        self._reset()

    def _reset(self) -> None:
        self.best = math.inf if self.mode == "min" else -math.inf
        self.wait = 0
        self.cooldown_counter = 0

    def _better(self, current: float, best: float) -> bool:
        if self.mode == "min":
            return current < best - self.min_delta
        return current > best + self.min_delta

    def in_cooldown(self) -> bool:
        return self.cooldown_counter > 0

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._reset()

    def _groups(self) -> list[dict[str, object]]:
        opt = self.optimizer
        if opt is None:
            raise RuntimeError("ReduceLROnPlateau needs the optimizer; it works only in fit")
        return list(opt.param_groups)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        groups = self._groups()
        if logs is not None:
            logs["learning_rate"] = float(groups[0]["lr"])  # type: ignore[arg-type]
        current = (logs or {}).get(self.monitor)
        if current is None:
            warn_user(
                f"ReduceLROnPlateau conditioned on the log {self.monitor!r}, which is not available; "
                f"available logs: {sorted(logs or {})}",
                stacklevel=2,
            )
            return
        if self.in_cooldown():
            self.cooldown_counter -= 1
            self.wait = 0
        if self._better(current, self.best):
            self.best = current
            self.wait = 0
        elif not self.in_cooldown():
            self.wait += 1
            if self.wait >= self.patience:
                lowered = False
                for group in groups:
                    old = float(group["lr"])  # type: ignore[arg-type]
                    if old > self.min_lr:
                        group["lr"] = max(old * self.factor, self.min_lr)
                        lowered = True
                if lowered:
                    new = float(groups[0]["lr"])  # type: ignore[arg-type]
                    if logs is not None:
                        logs["learning_rate"] = new
                    if self.verbose and self.is_chief:
                        print(f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new:g}.")
                    self.cooldown_counter = self.cooldown
                    self.wait = 0


class TerminateOnNaN(Callback):
    """Stop training when the loss becomes NaN or infinite (Keras's TerminateOnNaN).

    The batch logs are global, so every replica sees the same non-finite loss and sets
    ``stop_training`` at the same step; fit then stops every replica alike.
    """

    def __init__(self) -> None:
        super().__init__()
        self.terminated_at: int | None = None  # the step (of the epoch) whose loss was not finite

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        loss = (logs or {}).get("loss")
        if loss is None or math.isfinite(loss) or self.terminated_at is not None:
            return
        self.terminated_at = batch
        if self.is_chief:
            print(f"Batch {batch}: Invalid loss, terminating training")
        self.state.stop_training = True
