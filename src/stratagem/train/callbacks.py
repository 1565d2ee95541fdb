"""The callbacks users pass to fit: early stopping, checkpoints, backups, CSV/TensorBoard logs, LR.

Each hook runs on every replica with the same global logs, so decisions (stop, save, change the
learning rate) are the same everywhere; files are written by the chief replica only.
``Callback`` (the base to write your own) and ``Progress`` (fit's console output) are re-exported.
"""

from __future__ import annotations

import csv
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from stratagem.core.warn import warn_user
from stratagem.train.callback import Callback, FitState, Logs
from stratagem.train.progress import Progress
from stratagem.train.resume import FitProgress

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "FitState",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "Progress",
    "TensorBoard",
]


def _resolve_mode(mode: str, monitor: str) -> str:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max'; got {mode!r}")
    if mode != "auto":
        return mode
    name = monitor[4:] if monitor.startswith("val_") else monitor
    return "max" if name.endswith(("accuracy", "acc", "auc")) or name.startswith(("acc", "auc")) else "min"


def _improved(mode: str, current: float, best: float, min_delta: float) -> bool:
    if math.isnan(current):
        return False
    return current < best - min_delta if mode == "min" else current > best + min_delta


def _monitored(logs: Logs | None, monitor: str, who: str) -> float | None:
    value = (logs or {}).get(monitor)
    if value is None:
        warn_user(
            f"{who}: the monitored log {monitor!r} is not available (logs: "
            f"{sorted(logs or {})}); pass validation_data for val_ logs or monitor one of these",
            stacklevel=3,
        )
    return value


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` epochs (Keras semantics).

    The monitored value is global (summed across replicas), so every replica decides alike and
    fit stops them all at the same epoch. ``restore_best_weights`` puts back the parameters of
    the best epoch when it stops.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        *,
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ) -> None:
        super().__init__()
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.mode = _resolve_mode(mode, monitor)
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self.on_train_begin()

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.wait = 0
        self.stopped_epoch: int | None = None
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_epoch = 0
        self.best_weights: dict[str, torch.Tensor] | None = None

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if epoch < self.start_from_epoch:
            return
        current = _monitored(logs, self.monitor, "EarlyStopping")
        if current is None:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = self._snapshot()
        self.wait += 1
        if _improved(self.mode, current, self.best, self.min_delta):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = self._snapshot()
            if self.baseline is None or _improved(self.mode, current, self.baseline, self.min_delta):
                self.wait = 0
                return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.state.stop_training = True
            if self.restore_best_weights and self.best_weights is not None:
                with torch.no_grad():
                    self.model.load_state_dict(self.best_weights)


def _check_save_freq(save_freq: str | int) -> None:
    if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
        raise ValueError(f"save_freq must be 'epoch' or a positive number of steps; got {save_freq!r}")


def _directory_of(filepath: str) -> Path:
    """The checkpoint directory a Keras ``filepath`` stands for: before any ``{...}`` placeholder,
    and without a file name that has a suffix (``.keras``, ``.h5``, ``.pt``, ...)."""
    head = filepath.split("{", 1)[0]
    path = Path(head)
    if "{" in filepath or path.suffix:
        path = path.parent if not head.endswith(os.sep) else path
    return path if str(path) else Path(".")


class ModelCheckpoint(Callback):
    """Save the model (and optimizer) with a CheckpointManager in ``directory/ckpt-<step>``.

    ``save_freq="epoch"`` saves at each epoch end (step = epochs done); an integer ``n`` every
    ``n`` optimizer steps (step = steps done). With ``save_best_only`` it saves only when
    ``monitor`` improves (``mode`` min/max/auto, as EarlyStopping). Every replica takes part (the
    save is collective; the chief writes). ``max_to_keep`` bounds the checkpoints kept.
    Restore with ``CheckpointManager(Checkpoint(model=..., optimizer=...), directory).restore(path)``.

    Keras's spellings work: ``ModelCheckpoint(filepath="ckpt/model-{epoch:02d}.keras",
    monitor=..., save_best_only=..., save_weights_only=...)``. A stratagem checkpoint is a
    directory of numbered checkpoints, so ``filepath`` names that directory: its part before
    any ``{...}`` placeholder or file suffix (``ckpt/`` here); ``save_weights_only`` leaves out
    the optimizer.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        filepath: str | os.PathLike[str] | None = None,
        monitor: str = "val_loss",
        save_best_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        save_optimizer: bool = True,
        save_weights_only: bool = False,
        max_to_keep: int | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        _check_save_freq(save_freq)
        if (directory is None) == (filepath is None):
            raise ValueError("ModelCheckpoint needs a directory (or Keras's filepath=), exactly one of them")
        self.directory = Path(directory) if directory is not None else _directory_of(os.fspath(filepath or ""))
        save_optimizer = save_optimizer and not save_weights_only
        self.monitor = monitor
        self.save_best_only = save_best_only
        self.mode = _resolve_mode(mode, monitor)
        self.save_freq = save_freq
        self.save_optimizer = save_optimizer
        self.max_to_keep = max_to_keep
        self.best = math.inf if self.mode == "min" else -math.inf
        self.last_path: str | None = None
        self._manager: Any = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        from stratagem.train.checkpoint import Checkpoint, CheckpointManager

        objects: dict[str, Any] = {"model": self.model}
        if self.save_optimizer and self.optimizer is not None:
            objects["optimizer"] = self.optimizer
        self._manager = CheckpointManager(
            Checkpoint(**objects), self.directory, self.max_to_keep, strategy=self.state.strategy
        )

    def _save(self, step: int, logs: Logs | None) -> None:
        if self.save_best_only:
            current = _monitored(logs, self.monitor, "ModelCheckpoint")
            if current is None or not _improved(self.mode, current, self.best, 0.0):
                return
            self.best = current
        self.last_path = self._manager.save(step)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if isinstance(self.save_freq, int) and self.state.iterations % self.save_freq == 0:
            self._save(self.state.iterations, logs)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch + 1, logs)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._manager is not None:
            self._manager.close()  # training ended: the directory is no longer this run's


class BackupAndRestore(Callback):
    """Back up the run to ``backup_dir`` so an interrupted fit resumes where it stopped.

    Saved (with a CheckpointManager, atomically): model, optimizer, every replica's RNG states
    and fit's progress (epoch, step, data position, the epoch's metric totals, the History). A
    fit started with the same arguments and the same ``backup_dir`` restores the newest backup
    that verifies (skipping a corrupt one) and goes on from that epoch and step, giving the result
    of an uninterrupted run. ``save_freq="epoch"`` backs up at each epoch end, an integer ``n``
    every ``n`` steps too. With a stratagem Dataset the input resumes from its iterator state;
    other data are replayed from the start of the pass (exact only when re-iterating them gives
    the same batches). When training ends normally the backups are deleted
    (``delete_checkpoint=False`` keeps them). Put it before callbacks that should see the
    restored state. A backup also resumes on another number of replicas (position, History and
    the epoch's metric totals carry over; input auto-sharded by files is an error, and replicas
    beyond the saved ones keep their own RNG streams). The state of other callbacks (e.g.
    EarlyStopping's patience counter) is not backed up.
    """

    def __init__(
        self,
        backup_dir: str | os.PathLike[str],
        *,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        max_to_keep: int = 2,
    ) -> None:
        super().__init__()
        _check_save_freq(save_freq)
        self.backup_dir = Path(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = max_to_keep
        self.restored_from: str | None = None
        self._progress = FitProgress()
        self._manager: Any = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        from stratagem.train.checkpoint import Checkpoint, CheckpointManager, RNGState

        state = self.state
        if state.capture is None or state.restore is None or self.optimizer is None:
            raise RuntimeError("BackupAndRestore works only as a callback of stratagem.fit")
        checkpoint = Checkpoint(model=self.model, optimizer=self.optimizer, rng=RNGState(), fit=self._progress)
        self._manager = CheckpointManager(checkpoint, self.backup_dir, self.max_to_keep, strategy=state.strategy)
        self.restored_from = self._manager.restore_or_initialize()
        if self.restored_from is not None:
            state.restore(self._progress)

    def _backup(self, *, epoch_end: bool) -> None:
        assert self.state.capture is not None
        self.state.capture(self._progress, epoch_end=epoch_end)
        self._manager.save(self.state.iterations)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if isinstance(self.save_freq, int) and self.state.iterations % self.save_freq == 0:
            self._backup(epoch_end=False)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            self.state.history.update_last(logs)
        self._backup(epoch_end=True)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._manager is None:
            return
        if not self.delete_checkpoint:
            self._manager.close()
            return
        self.state.strategy.barrier()
        if self.is_chief:
            for path in self._manager.checkpoints:
                shutil.rmtree(path, ignore_errors=True)
            self._manager.close()
        self.state.strategy.barrier()


class LearningRateScheduler(Callback):
    """Set every parameter group's learning rate to ``schedule(epoch, lr)`` at each epoch start.

    ``schedule`` may also take only ``epoch``. The rate is logged as ``learning_rate``. A run
    resumed in the middle of an epoch keeps the restored optimizer's rate for that epoch.
    """

    def __init__(self, schedule: Callable[..., float], verbose: int = 0) -> None:
        super().__init__()
        self.schedule = schedule
        self.verbose = verbose

    def _optimizer(self) -> torch.optim.Optimizer:
        opt = self.optimizer
        if opt is None:
            raise RuntimeError("LearningRateScheduler needs the optimizer; it works only in fit")
        return opt

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        if self.state.step > 0:
            return
        opt = self._optimizer()
        lr = float(opt.param_groups[0]["lr"])
        try:
            new = self.schedule(epoch, lr)
        except TypeError:
            new = self.schedule(epoch)
        new = float(new)
        if not math.isfinite(new):
            raise ValueError(f"the learning rate schedule returned {new} for epoch {epoch}; return a finite number")
        for group in opt.param_groups:
            group["lr"] = new
        if self.verbose and self.state.strategy.extended.replica_id == 0:
            print(f"Epoch {epoch + 1}: LearningRateScheduler setting learning rate to {new:g}.")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = float(self._optimizer().param_groups[0]["lr"])


class CSVLogger(Callback):
    """Append one row per epoch (``epoch`` and every log) to a CSV file, on the chief replica."""

    def __init__(self, filename: str | os.PathLike[str], separator: str = ",", append: bool = False) -> None:
        super().__init__()
        self.filename = Path(filename)
        self.separator = separator
        self.append = append
        self._file: IO[str] | None = None
        self._writer: Any = None
        self._keys: list[str] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if not self.is_chief:
            return
        self._keys = None
        exists = self.filename.exists() and self.filename.stat().st_size > 0
        if self.append and exists:
            with open(self.filename, newline="") as f:
                header = next(csv.reader(f, delimiter=self.separator), None)
            self._keys = header[1:] if header else None
        self.filename.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.filename, "a" if self.append else "w", newline="")  # noqa: SIM115

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._file is None:
            return
        logs = dict(logs or {})
        if self._writer is None:
            if self._keys is None:
                self._keys = sorted(logs)
                header = True
            else:
                header = False
            self._writer = csv.DictWriter(
                self._file, fieldnames=["epoch", *self._keys], delimiter=self.separator, extrasaction="ignore"
            )
            if header:
                self._writer.writeheader()
        self._writer.writerow({"epoch": epoch, **{k: logs.get(k, "NA") for k in self._keys or []}})
        self._file.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None
        self._writer = None


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(
            "the TensorBoard callback needs the tensorboard package, which is not installed; "
            "install it with `pip install tensorboard` (or `pip install stratagem[tensorboard]`), "
            "or log with CSVLogger instead"
        ) from e
    return SummaryWriter


class TensorBoard(Callback):
    """Write the logs as TensorBoard scalars (``log_dir/train``, ``log_dir/validation``), on the chief.

    ``update_freq="epoch"`` writes once per epoch (``epoch_loss``, ...); an integer ``n`` also
    writes the running training logs every ``n`` steps (``batch_loss``, ... against the step).
    Needs the ``tensorboard`` package; constructing it without raises an ImportError saying so.
    """

    def __init__(self, log_dir: str | os.PathLike[str] = "logs", update_freq: str | int = "epoch") -> None:
        super().__init__()
        if update_freq != "epoch" and not (isinstance(update_freq, int) and update_freq > 0):
            raise ValueError(f"update_freq must be 'epoch' or a positive number of steps; got {update_freq!r}")
        self._writer_class = _summary_writer_class()
        self.log_dir = Path(log_dir)
        self.update_freq = update_freq
        self._writers: dict[str, Any] = {}

    def _writer(self, which: str) -> Any:
        if which not in self._writers:
            self._writers[which] = self._writer_class(log_dir=str(self.log_dir / which))
        return self._writers[which]

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if not isinstance(self.update_freq, int) or not self.is_chief or not logs:
            return
        step = self.state.iterations
        if step % self.update_freq == 0:
            for k, v in logs.items():
                self._writer("train").add_scalar(f"batch_{k}", v, step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self.is_chief:
            return
        for k, v in (logs or {}).items():
            if k.startswith("val_"):
                self._writer("validation").add_scalar(f"epoch_{k[4:]}", v, epoch)
            else:
                self._writer("train").add_scalar(f"epoch_{k}", v, epoch)
        for w in self._writers.values():
            w.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        for w in self._writers.values():
            w.close()
        self._writers = {}

