"""MLflowLogger and WandbLogger: fit's logs sent to an experiment tracker, by the chief replica only.

Both are optional extras: the tracker's package is imported when the callback is built, and a
missing one is an ImportError that says what to install. They log fit's arguments once, the
epoch logs (training and ``val_``) after each epoch, and with ``update_freq=n`` the running
training logs every ``n`` optimizer steps. Only the chief (``is_chief``) talks to the tracker.
"""

from __future__ import annotations

import abc
import importlib
import os
from typing import Any, final

from stratagem.train.callback import Callback, Logs

__all__ = ["MLflowLogger", "WandbLogger"]


def _import(module: str, package: str, callback: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{callback} needs the {package} package, which is not installed; install it with "
            f"`pip install {package}`, or log with stratagem.callbacks.CSVLogger instead"
        ) from e


def _check_update_freq(update_freq: str | int) -> None:
    if update_freq != "epoch" and not (isinstance(update_freq, int) and update_freq > 0):
        raise ValueError(f"update_freq must be 'epoch' or a positive number of steps; got {update_freq!r}")


class TrackerLogger(Callback, abc.ABC):
    """What the tracker loggers share: when to log and who logs (the chief)."""

    def __init__(self, update_freq: str | int) -> None:
        super().__init__()
        _check_update_freq(update_freq)
        self.update_freq = update_freq
        self._open = False

    @abc.abstractmethod
    def _start(self, params: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def _log(self, metrics: dict[str, float], step: int, kind: str) -> None: ...

    @abc.abstractmethod
    def _finish(self) -> None: ...

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if not self.is_chief:
            return
        params = {k: v for k, v in self.params.items() if isinstance(v, (int, float, str, bool))}
        self._start(params)
        self._open = True

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if not self._open or not isinstance(self.update_freq, int) or not logs:
            return
        step = self.state.iterations
        if step % self.update_freq == 0:
            self._log({f"batch_{k}": float(v) for k, v in logs.items()}, step, "batch")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._open and logs:
            self._log({k: float(v) for k, v in logs.items()}, epoch, "epoch")

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._open:
            self._open = False
            self._finish()


@final
class MLflowLogger(TrackerLogger):
    """Log fit to MLflow: ``tracking_uri`` (``"file:./mlruns"``, a server), ``experiment_name``.

    Opens a run named ``run_name`` (with ``tags``) unless one is active, logs fit's arguments and
    ``params`` as parameters, epoch logs with ``step=epoch`` and batch logs (``batch_loss``...)
    with ``step=`` the optimizer step; ends the run it opened. Needs ``pip install mlflow`` (or
    ``mlflow-skinny``). MLflow 3 refuses a local file store (``file:``) unless
    ``MLFLOW_ALLOW_FILE_STORE=true``; ``sqlite:///mlflow.db`` needs the full ``mlflow``.
    """

    def __init__(
        self,
        experiment_name: str | None = None,
        run_name: str | None = None,
        tracking_uri: str | os.PathLike[str] | None = None,
        *,
        tags: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        update_freq: str | int = "epoch",
    ) -> None:
        super().__init__(update_freq)
        self._mlflow = _import("mlflow", "mlflow", "MLflowLogger")
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tracking_uri = os.fspath(tracking_uri) if tracking_uri is not None else None
        self.tags = dict(tags or {})
        self.extra_params = dict(params or {})
        self.run_id: str | None = None
        self._owns_run = False

    def _start(self, params: dict[str, Any]) -> None:
        mlflow = self._mlflow
        if self.tracking_uri is not None:
            mlflow.set_tracking_uri(self.tracking_uri)
        if self.experiment_name is not None:
            mlflow.set_experiment(self.experiment_name)
        run = mlflow.active_run()
        self._owns_run = run is None
        if run is None:
            run = mlflow.start_run(run_name=self.run_name, tags=self.tags or None)
        self.run_id = run.info.run_id
        mlflow.log_params({**params, **self.extra_params})

    def _log(self, metrics: dict[str, float], step: int, kind: str) -> None:
        self._mlflow.log_metrics(metrics, step=step)

    def _finish(self) -> None:
        if self._owns_run:
            self._mlflow.end_run()


@final
class WandbLogger(TrackerLogger):
    """Log fit to Weights & Biases: ``wandb.init(project=, name=, config=, mode=, dir=, ...)``.

    ``mode="offline"`` writes the run under ``dir`` for a later ``wandb sync``. Epoch logs are
    logged with ``epoch``; batch logs (``batch_loss``...) with ``iteration``; fit's arguments
    and ``config`` go to the run's config. Needs ``pip install wandb``.
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        *,
        config: dict[str, Any] | None = None,
        mode: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        update_freq: str | int = "epoch",
        **init_kwargs: Any,
    ) -> None:
        super().__init__(update_freq)
        self._wandb = _import("wandb", "wandb", "WandbLogger")
        self.init_kwargs: dict[str, Any] = {"project": project, "name": name, "mode": mode, **init_kwargs}
        if dir is not None:
            self.init_kwargs["dir"] = os.fspath(dir)
        self.config = dict(config or {})
        self.run: Any = None

    def _start(self, params: dict[str, Any]) -> None:
        kwargs = {k: v for k, v in self.init_kwargs.items() if v is not None}
        self.run = self._wandb.init(config={**params, **self.config}, **kwargs)

    def _log(self, metrics: dict[str, float], step: int, kind: str) -> None:
        self.run.log({**metrics, "epoch" if kind == "epoch" else "iteration": step})

    def _finish(self) -> None:
        self.run.finish()
        self.run = None
