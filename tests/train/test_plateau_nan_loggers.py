"""ReduceLROnPlateau and TerminateOnNaN decide alike on 2 replicas; MLflow and W&B loggers write one
run (the chief's) offline; a missing tracker package is an ImportError saying what to install."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.callbacks import MLflowLogger, ReduceLROnPlateau, TerminateOnNaN, WandbLogger


def _data(n_batches: int, bad_batch: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n_batches):
        x, y = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)
        if i == bad_batch:
            x[5] = float("nan")  # one example, on replica 1's half of the global batch
        out.append((x, y))
    return out


def _agree(strategy, values: list[float]) -> bool:
    rows = strategy.gather(torch.tensor([values], dtype=torch.float64), axis=0)  # one row per replica
    return rows.shape[0] == 2 and bool(torch.equal(rows[0], rows[1]))


def train_with_callbacks(tmp: str, loggers: bool) -> dict:
    strategy = sg.MirroredStrategy("cpu", num_replicas=2)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    callbacks: list = [ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1e9, min_lr=0.02)]
    if loggers:
        callbacks.append(MLflowLogger("issue16", "plateau", tracking_uri=Path(tmp, "mlruns").as_uri(), params={"note": "x"}))
        callbacks.append(WandbLogger(project="issue16", mode="offline", dir=tmp, update_freq=1))
    h = sg.fit(model, opt, nn.MSELoss(reduction="none"), _data(4), epochs=4, callbacks=callbacks, verbose=0, steps_per_execution=1)
    lrs = h.history["learning_rate"]

    torch.manual_seed(0)
    with strategy.scope():
        model2 = nn.Linear(3, 1)
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    nan = TerminateOnNaN()
    h2 = sg.fit(model2, opt2, nn.MSELoss(reduction="none"), _data(4, bad_batch=1), epochs=3, callbacks=[nan], verbose=0, steps_per_execution=1)
    return {
        "lrs": lrs,
        "lrs_agree": _agree(strategy, lrs),
        "nan_epochs": len(h2.history["loss"]),
        "terminated_at": nan.terminated_at,
        "terminated_agree": _agree(strategy, [float(nan.terminated_at if nan.terminated_at is not None else -1)]),
    }


# in the slow tier (10-20 s; CI runs it): the main tier stays under 15 minutes
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plateau_and_nan_decide_alike_and_loggers_write_once(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    env = {"WANDB_SILENT": "true", "WANDB_MODE": "offline", "MLFLOW_ENABLE_ASYNC_LOGGING": "false",
           "MLFLOW_ALLOW_FILE_STORE": "true"}  # MLflow 3's local file store, still supported
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    r = sg.launch(train_with_callbacks, str(tmp_path), True, num_replicas=2, timeout=110, env=env)
    # Keras semantics: best at epoch 0; then a plateau each epoch (min_delta is huge): halved, floored
    assert r["lrs"] == pytest.approx([0.1, 0.05, 0.025, 0.02])
    assert r["lrs_agree"]
    # the NaN on replica 1 makes the global loss NaN on both: both stop at the same step
    assert r["terminated_at"] == 1 and r["terminated_agree"]
    assert r["nan_epochs"] == 1

    # MLflow's local store: one run (the chief's), its params and per-epoch metrics
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    exp = client.get_experiment_by_name("issue16")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.data.params["epochs"] == "4" and run.data.params["note"] == "x"
    assert run.data.params["num_replicas"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1, 2, 3]
    lr = [m.value for m in client.get_metric_history(run.info.run_id, "learning_rate")]
    assert lr == pytest.approx([0.1, 0.05, 0.025, 0.02])
    # W&B offline: one run directory (the chief's) with the epoch and batch logs
    runs_dir = [p for p in (tmp_path / "wandb").iterdir() if p.name.startswith("offline-run-")]
    assert len(runs_dir) == 1
    # (the offline record log is protobuf; its keys and JSON values are stored as plain bytes)
    (log,) = runs_dir[0].glob("run-*.wandb")
    records = log.read_bytes()
    for key in (b"batch_loss", b"learning_rate", b"iteration", b"epoch", b"0.025", b"0.02"):
        assert key in records, key


def test_missing_tracker_packages_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"MLflowLogger needs the mlflow package.*pip install mlflow"):
        MLflowLogger()
    with pytest.raises(ImportError, match=r"WandbLogger needs the wandb package.*pip install wandb"):
        WandbLogger(mode="offline")


def test_reduce_lr_on_plateau_arguments():
    with pytest.raises(ValueError, match="factor >= 1.0"):
        ReduceLROnPlateau(factor=1.5)
    assert ReduceLROnPlateau(monitor="val_accuracy").mode == "max"
    assert ReduceLROnPlateau(epsilon=0.5).min_delta == 0.5  # Keras 2's name
