"""The callbacks users pass to fit: early stopping, checkpoints, backups, CSV/TensorBoard logs, LR.

Each hook runs on every replica with the same global logs, so decisions (stop, save, change the
learning rate) are the same everywhere; files are written by the chief replica only.
``Callback`` (the base to write your own) and ``Progress`` (fit's console output) are re-exported.
"""

from __future__ import annotations

import csv
import json
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
    "LambdaCallback",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "Progress",
    "TensorBoard",
    "latest_checkpoint",
    "load_weights",
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
    the best epoch when it stops. ``verbose=1`` prints Keras's messages (``Epoch 5: early
    stopping``, and which epoch's weights were restored), on the chief.
    """

    may_stop_per_batch = False

    def __init__(
        self,
        monitor: str = "val_loss",
        *,
        min_delta: float = 0.0,
        patience: int = 0,
        verbose: int = 0,
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
        self.verbose = verbose
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
                if self.verbose > 0 and self._state is not None and self.is_chief:
                    print(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.", flush=True)
                with torch.no_grad():
                    self.model.load_state_dict(self.best_weights)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.stopped_epoch is not None and self.stopped_epoch > 0 and self.verbose > 0 and self.is_chief:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping", flush=True)


def _check_save_freq(save_freq: str | int) -> None:
    if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
        raise ValueError(f"save_freq must be 'epoch' or a positive number of steps; got {save_freq!r}")


#: File suffixes that mark a positional ``ModelCheckpoint`` argument as Keras's ``filepath``.
_KERAS_SUFFIXES = (".keras", ".h5")

#: TensorFlow's checkpoint state file (``tf.train.latest_checkpoint`` reads it): the newest save.
STATE_FILE = "checkpoint"

#: Where ModelCheckpoint stages a save before renaming it to its formatted ``filepath``.
_STAGING = ".stratagem-modelcheckpoint"


def _is_template(path: str) -> bool:
    """Whether a positional ModelCheckpoint argument is Keras's ``filepath`` (a ``{placeholder}``
    or a Keras file suffix) rather than a directory of numbered checkpoints."""
    return "{" in path or path.endswith(_KERAS_SUFFIXES)


def _write_state_file(directory: Path, latest: Path, all_paths: list[Path]) -> None:
    """TensorFlow's ``checkpoint`` state file: the newest save and every save kept, by name."""
    lines = [f'model_checkpoint_path: "{latest.name}"']
    lines += [f'all_model_checkpoint_paths: "{p.name}"' for p in all_paths if p.parent == directory]
    tmp = directory / f".{STATE_FILE}.tmp-{os.getpid()}"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, directory / STATE_FILE)


def _read_state_file(directory: Path) -> str | None:
    try:
        text = (directory / STATE_FILE).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model_checkpoint_path":
            return value.strip().strip('"')
    return None


def _saved_step(path: Path) -> int | None:
    try:
        return int(json.loads((path / "metadata.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> str | None:
    """The newest checkpoint saved in ``checkpoint_dir`` (TensorFlow's ``tf.train.latest_checkpoint``),
    or None when there is none.

    The newest is the last one saved, as TensorFlow's state file records it (``ModelCheckpoint``
    writes ``checkpoint_dir/checkpoint``), never the last by sorted name: ``ckpt_12`` is newer than
    ``ckpt_9``. Without a state file (a ``CheckpointManager``'s ``ckpt-<step>`` directories), the
    checkpoint with the highest saved step. Restore it with ``sg.train.load_weights(model, path)``
    (or ``CheckpointManager.restore(path)`` for the optimizer too)."""
    directory = Path(checkpoint_dir)
    named = _read_state_file(directory)
    if named is not None:
        if (directory / named / "metadata.json").exists():
            return os.path.join(os.fspath(checkpoint_dir), named)  # as TF: the directory as given
    found = []
    for p in directory.iterdir() if directory.is_dir() else []:
        step = _saved_step(p) if p.is_dir() and not p.name.startswith(".") else None
        if step is not None:
            found.append((step, (p / "metadata.json").stat().st_mtime, p))
    return str(max(found, key=lambda f: (f[0], f[1]))[2]) if found else None


def load_weights(model: torch.nn.Module, filepath: str | os.PathLike[str]) -> torch.nn.Module:
    """Keras's ``model.load_weights(filepath)`` for a torch module: load the weights saved as
    ``"model"`` in the checkpoint at ``filepath`` (from ``ModelCheckpoint``, ``CheckpointManager``;
    a manager's directory means its newest). Call it on every replica. Returns ``model``."""
    from stratagem.train.checkpoint import load_state_dict

    with torch.no_grad():
        model.load_state_dict(load_state_dict(filepath, name="model"))
    return model


class ModelCheckpoint(Callback):
    """Save the model (and optimizer) at each epoch end or every ``save_freq`` steps (Keras's
    ModelCheckpoint), as stratagem checkpoints (a directory of safetensors and JSON files).

    Keras's form, ``ModelCheckpoint(filepath="ckpt/ckpt_{epoch:04d}", save_weights_only=True)``
    (``filepath`` may also be given positionally when it has a ``{placeholder}`` or ends in
    ``.keras``/``.h5``): each save goes to ``filepath.format(epoch=epoch + 1, **logs)`` (also
    ``batch=`` with an integer ``save_freq``, as Keras; ``{val_loss:.2f}`` takes the logs),
    exactly that path, relative to the working directory when relative (as in Keras), replacing
    a checkpoint already there (``filepath="best.keras", save_best_only=True`` keeps the best).
    The checkpoint there is stratagem's format whatever the suffix (not Keras's ``.keras`` zip
    or ``.h5``); ``save_weights_only`` leaves the optimizer out. Each save also updates
    TensorFlow's state file ``checkpoint`` in that directory, so ``latest_checkpoint(dir)``
    (``tf.train.latest_checkpoint``) returns the newest save, and ``load_weights(model, path)``
    (``model.load_weights``) restores it.

    stratagem's form, ``ModelCheckpoint(directory)``: a CheckpointManager's numbered checkpoints
    ``directory/ckpt-<step>`` (step = epochs done, or optimizer steps done with an integer
    ``save_freq``), at most ``max_to_keep`` of them; restore with
    ``CheckpointManager(Checkpoint(model=..., optimizer=...), directory).restore(path)``.

    With ``save_best_only`` it saves only when ``monitor`` improves (``mode`` min/max/auto, as
    EarlyStopping). ``verbose=1`` prints Keras's messages (on the chief). Every replica takes part
    (the save is collective; the chief writes).
    """

    may_stop_per_batch = False

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
        initial_value_threshold: float | None = None,
    ) -> None:
        super().__init__()
        _check_save_freq(save_freq)
        if (directory is None) == (filepath is None):
            raise ValueError("ModelCheckpoint needs Keras's filepath= (or a directory), exactly one of them")
        if directory is not None and _is_template(os.fspath(directory)):
            filepath, directory = directory, None
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        self.filepath = os.fspath(filepath) if filepath is not None else None
        self.directory = Path(directory) if directory is not None else None
        self.monitor = monitor
        self.save_best_only = save_best_only
        self.mode = _resolve_mode(mode, monitor)
        self.save_freq = save_freq
        self.save_optimizer = save_optimizer and not save_weights_only
        self.save_weights_only = save_weights_only
        self.max_to_keep = max_to_keep
        self.verbose = verbose
        self.best: float | None = initial_value_threshold
        self.last_path: str | None = None
        self.saved: list[str] = []  # Keras-form saves, oldest first (distinct paths)
        self._managers: dict[Path, Any] = {}
        self._epoch = 0

    def _checkpoint(self) -> Any:
        from stratagem.train.checkpoint import Checkpoint

        objects: dict[str, Any] = {"model": self.model}
        if self.save_optimizer and self.optimizer is not None:
            objects["optimizer"] = self.optimizer
        return Checkpoint(**objects)

    def _manager(self, directory: Path, max_to_keep: int | None) -> Any:
        from stratagem.train.checkpoint import CheckpointManager

        manager = self._managers.get(directory)
        if manager is None:
            manager = CheckpointManager(self._checkpoint(), directory, max_to_keep, strategy=self.state.strategy)
            self._managers[directory] = manager
        return manager

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._managers = {}
        if self.directory is not None:
            self._manager(self.directory, self.max_to_keep)

    def _say(self, text: str) -> None:
        if self.verbose and self.is_chief:
            print(text, flush=True)

    def _should_save(self, epoch: int, logs: Logs | None, where: str) -> bool:
        if not self.save_best_only:
            self._say(f"\nEpoch {epoch + 1}: saving model to {where}")
            return True
        current = _monitored(logs, self.monitor, "ModelCheckpoint")
        if current is None:
            return False
        start = math.inf if self.mode == "min" else -math.inf  # Keras's best before any value
        best = f"{self.best if self.best is not None else start:.5f}"
        if self.best is None or _improved(self.mode, current, self.best, 0.0):
            self._say(f"\nEpoch {epoch + 1}: {self.monitor} improved from {best} to {current:.5f}, saving model to {where}")
            self.best = current
            return True
        self._say(f"\nEpoch {epoch + 1}: {self.monitor} did not improve from {best}")
        return False

    def _format(self, epoch: int, batch: int | None, logs: Logs | None) -> str:
        assert self.filepath is not None
        values = dict(logs or {})
        try:
            if batch is None or "batch" in values:
                return self.filepath.format(epoch=epoch + 1, **values)
            return self.filepath.format(epoch=epoch + 1, batch=batch + 1, **values)
        except KeyError as e:
            raise KeyError(
                f'Failed to format this callback filepath: "{self.filepath}". Reason: {e} (the logs '
                f"are {sorted(values)}; pass validation_data for val_ logs)"
            ) from e

    def _save(self, epoch: int, batch: int | None, step: int, logs: Logs | None) -> None:
        if self.directory is not None:
            if self._should_save(epoch, logs, str(self.directory / f"ckpt-{step}")):
                self.last_path = self._manager(self.directory, self.max_to_keep).save(step)
                self._say(f"\nEpoch {epoch + 1}: finished saving model to {self.last_path}")
            return
        where = self._format(epoch, batch, logs)
        target = Path(where)
        if not self._should_save(epoch, logs, where):
            return
        staged = self._manager(target.parent / _STAGING, None).save(step)  # collective; rank 0 writes
        if self.state.strategy.extended.world.rank == 0:  # the writer moves it into place
            self._commit(Path(staged), target)
        self.state.strategy.barrier()  # every replica sees the checkpoint at its path
        self.last_path = where
        self._say(f"\nEpoch {epoch + 1}: finished saving model to {where}")

    def _commit(self, staged: Path, target: Path) -> None:
        """On the writer: the staged checkpoint renamed to ``target`` (a previous one there moved
        aside first, removed once replaced), the oldest saves beyond ``max_to_keep`` removed, and
        TensorFlow's state file updated."""
        from stratagem.train.checkpoint.lock import replace_directory

        replace_directory(staged, target)
        key = str(target)
        self.saved = [p for p in self.saved if p != key] + [key]
        if self.max_to_keep is not None:
            for p in self.saved[: max(0, len(self.saved) - self.max_to_keep)]:
                shutil.rmtree(p, ignore_errors=True)
            self.saved = self.saved[-self.max_to_keep :]
        _write_state_file(target.parent, target, [Path(p) for p in self.saved])

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if isinstance(self.save_freq, int) and self.state.iterations % self.save_freq == 0:
            self._save(self._epoch, batch, self.state.iterations, logs)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, None, epoch + 1, logs)

    def on_train_end(self, logs: Logs | None = None) -> None:
        for directory, manager in self._managers.items():
            manager.close()  # training ended: the directory is no longer this run's
            if directory.name == _STAGING and self.state.strategy.extended.world.rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
        self._managers = {}


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

    may_stop_per_batch = False

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


class LambdaCallback(Callback):
    """Keras's ``LambdaCallback``: hooks given as functions, ``on_epoch_begin(epoch, logs)``,
    ``on_epoch_end(epoch, logs)``, ``on_train_begin(logs)``, ``on_train_end(logs)``,
    ``on_train_batch_begin(batch, logs)``, ``on_train_batch_end(batch, logs)``, and any other
    hook by its name (``on_test_batch_end=...``). A batch hook given makes fit log every batch
    (``steps_per_execution="auto"`` keeps one step per execution), as any callback's."""

    def __init__(
        self,
        on_epoch_begin: Callable[..., Any] | None = None,
        on_epoch_end: Callable[..., Any] | None = None,
        on_train_begin: Callable[..., Any] | None = None,
        on_train_end: Callable[..., Any] | None = None,
        on_train_batch_begin: Callable[..., Any] | None = None,
        on_train_batch_end: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        hooks = dict(kwargs, on_epoch_begin=on_epoch_begin, on_epoch_end=on_epoch_end, on_train_begin=on_train_begin,
                     on_train_end=on_train_end, on_train_batch_begin=on_train_batch_begin,
                     on_train_batch_end=on_train_batch_end)
        for name, fn in hooks.items():
            if fn is None:
                continue
            if not (name.startswith("on_") and callable(getattr(Callback, name, None))):
                raise ValueError(
                    f"LambdaCallback: {name!r} is not a callback hook; hooks are on_epoch_begin/end, "
                    "on_train_begin/end, on_(train|test|predict)_batch_begin/end, on_test_begin/end, ..."
                )
            setattr(self, name, fn)


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
    Keras's other arguments are taken at their "off" values (``histogram_freq=0``,
    ``embeddings_freq=0``, ``profile_batch=0``, ``write_images=False``,
    ``write_steps_per_second=False``); asking for those features is a clear error. No graph is
    written (a torch module has no Keras graph), whatever ``write_graph`` says.
    """

    may_stop_per_batch = False

    def __init__(
        self,
        log_dir: str | os.PathLike[str] = "logs",
        histogram_freq: int = 0,
        write_graph: bool = True,
        write_images: bool = False,
        write_steps_per_second: bool = False,
        update_freq: str | int = "epoch",
        profile_batch: int = 0,
        embeddings_freq: int = 0,
        embeddings_metadata: Any = None,
    ) -> None:
        super().__init__()
        asked = {"histogram_freq": histogram_freq, "write_images": write_images,
                 "write_steps_per_second": write_steps_per_second, "profile_batch": profile_batch,
                 "embeddings_freq": embeddings_freq, "embeddings_metadata": embeddings_metadata}
        unsupported = sorted(k for k, v in asked.items() if v)
        if unsupported:
            raise ValueError(
                f"TensorBoard: {', '.join(f'{k}={asked[k]!r}' for k in unsupported)} not offered; stratagem's "
                "TensorBoard writes the logs' scalars (epoch_*, and batch_* with an integer update_freq)"
            )
        del write_graph
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

