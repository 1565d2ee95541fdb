"""fit/evaluate/predict on one process: loss forms, data forms, callbacks, History, progress."""

from __future__ import annotations

import io
import sys
import types
from typing import Any

import pytest
import torch
from fit_workers import build, global_batches, make_model, params_of, train
from torch import nn
from torch.nn import functional as F

import stratagem as sg
from stratagem.data import Dataset
from stratagem.testing.contracts import train_reference
from stratagem.train import callbacks as C
from stratagem.train import evaluate, fit, metrics, predict

SIZES = [8, 8, 5, 1]


def _assert_same(a: dict, b: dict, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


def _same_history(a, b, rel: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=rel), k


def _per_example(out, y):
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize(
    "loss_fn", [nn.CrossEntropyLoss(), _per_example, lambda out, y: F.cross_entropy(out, y)], ids=["module", "per_example", "scalar"]
)
def test_every_loss_form_trains_like_plain_pytorch(loss_fn):
    data = global_batches(SIZES)
    want = train_reference(make_model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), _per_example, data)
    model, opt = build(sg.OneDeviceStrategy())
    fit(model, opt, loss_fn, data, verbose=0)  # strategy=None: the default strategy
    _assert_same(params_of(model), want)


def test_data_forms_agree_and_steps_per_epoch_continues_a_pass():
    data = global_batches([8, 8, 8, 8])
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    s = sg.OneDeviceStrategy()
    ref_model, ref_hist = train(s, data, epochs=2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    for source in (loader, Dataset.from_tensor_slices((x, y)).batch(8)):
        model, hist = train(s, source, epochs=2)
        _assert_same(params_of(model), params_of(ref_model))
        _same_history(hist.history, ref_hist.history)
    # an infinite dataset, 2 steps an epoch: epochs go on where the last one stopped
    model, hist = train(s, Dataset.from_tensor_slices((x, y)).batch(8).repeat(), epochs=4, steps_per_epoch=2)
    ref_model, _ = train(s, data + data, epochs=1)
    _assert_same(params_of(model), params_of(ref_model))
    assert hist.epoch == [0, 1, 2, 3] and hist.params["steps"] == 2


def test_evaluate_and_predict_match_plain_pytorch():
    data = global_batches(SIZES)
    model, _ = train(sg.OneDeviceStrategy(), data)
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    with torch.no_grad():
        out = model(x)
    got = predict(model, data)
    torch.testing.assert_close(got, out)
    assert predict(model, [b[0] for b in data]).shape == (22, 3)
    res = evaluate(model, nn.CrossEntropyLoss(), data, metrics=["sparse_categorical_accuracy"], return_dict=True)
    assert res["loss"] == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-6)
    assert res["sparse_categorical_accuracy"] == (out.argmax(1) == y).sum().item() / 22


def test_errors_say_what_was_received_and_what_to_do():
    model, opt = build(sg.OneDeviceStrategy())
    data = global_batches([4])
    with pytest.raises(ValueError, match=r"reduction='sum'"):
        fit(model, opt, nn.CrossEntropyLoss(reduction="sum"), data, verbose=0)
    with pytest.raises(TypeError, match="can be read only once"):
        fit(model, opt, nn.CrossEntropyLoss(), iter(data), verbose=0)
    with pytest.raises(ValueError, match=r"tuple \(x, y\)"):
        fit(model, opt, nn.CrossEntropyLoss(), [b[0] for b in data], verbose=0)
    with pytest.raises(ValueError, match=r"shape \(2,\) for a batch of 4"):
        fit(model, opt, lambda o, y: o[:2, 0], data, verbose=0)
    with pytest.raises(ValueError, match="verbose must be"):
        fit(model, opt, nn.CrossEntropyLoss(), data, verbose=3)


class Recorder(C.Callback):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def on_train_begin(self, logs=None):
        self.calls.append("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(f"epoch_begin {epoch}")

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(f"batch_end {batch} {sorted(logs)}")

    def on_test_end(self, logs=None):
        self.calls.append("test_end")

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(f"epoch_end {epoch} {sorted(logs)}")

    def on_train_end(self, logs=None):
        self.calls.append("train_end")


def test_callbacks_hooks_scheduler_csv_and_early_stopping(tmp_path):
    data = global_batches([8, 3])
    rec = Recorder()
    sched = C.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))
    csv = C.CSVLogger(tmp_path / "log.csv")
    model, opt = build(sg.OneDeviceStrategy())
    hist = fit(model, opt, nn.CrossEntropyLoss(), data, epochs=2, validation_data=data[:1], metrics=["sparse_categorical_accuracy"], callbacks=[rec, sched, csv], verbose=0)
    keys = ["loss", "sparse_categorical_accuracy"]
    vkeys = sorted(keys + ["val_" + k for k in keys])
    assert rec.calls == [
        "train_begin", "epoch_begin 0", f"batch_end 0 {keys}", f"batch_end 1 {keys}", "test_end", f"epoch_end 0 {vkeys}",
        "epoch_begin 1", f"batch_end 0 {keys}", f"batch_end 1 {keys}", "test_end", f"epoch_end 1 {vkeys}", "train_end",
    ]
    assert hist.history["learning_rate"] == [0.1, 0.05]
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert rows[0] == "epoch,learning_rate,loss,sparse_categorical_accuracy,val_loss,val_sparse_categorical_accuracy"
    assert len(rows) == 3 and rows[2].startswith("1,0.05,")
    # EarlyStopping: no epoch can improve by 1e9, so it stops after `patience` epochs without one
    model, opt = build(sg.OneDeviceStrategy())
    early = C.EarlyStopping("loss", min_delta=1e9, patience=2, restore_best_weights=True)
    snap = C.Callback()

    class Snap(C.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                self.first = params_of(self.model)

    snap = Snap()
    hist = fit(model, opt, nn.CrossEntropyLoss(), data, epochs=10, callbacks=[snap, early], verbose=0)
    assert hist.epoch == [0, 1, 2] and early.stopped_epoch == 2 and early.best_epoch == 0
    _assert_same(params_of(model), snap.first, rtol=0, atol=0)


def test_history_plot(tmp_path, monkeypatch):
    _, hist = train(sg.OneDeviceStrategy(), global_batches([8]), epochs=2, validation_data=global_batches([4]), metrics=["sparse_categorical_accuracy"])
    assert set(hist.history) == {"loss", "sparse_categorical_accuracy", "val_loss", "val_sparse_categorical_accuracy"}
    path = hist.plot(tmp_path / "plots" / "history.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        hist.plot(tmp_path / "again.png")


def test_tensorboard_needs_tensorboard_and_writes_scalars(tmp_path, monkeypatch):
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            C.TensorBoard(tmp_path)
    written: list[tuple[str, str, float, int]] = []

    class FakeWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            written.append((self.log_dir, tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    tb = C.TensorBoard(tmp_path, update_freq=1)
    train(sg.OneDeviceStrategy(), global_batches([4, 4]), epochs=1, validation_data=global_batches([4]), callbacks=[tb])
    tags = {(d.rsplit("/", 1)[-1], t, s) for d, t, _, s in written}
    assert {("train", "batch_loss", 1), ("train", "batch_loss", 2), ("train", "epoch_loss", 0), ("validation", "epoch_loss", 0)} <= tags


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_modes(capsys):
    data = global_batches([8, 8])
    train(sg.OneDeviceStrategy(), data, epochs=2, verbose=2)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" - ")[0] for line in out] == ["Epoch 1/2", "Epoch 2/2"]
    assert all("loss: " in line and "samples/s" in line for line in out)
    train(sg.OneDeviceStrategy(), data, epochs=2, verbose="auto")  # not a terminal: lines
    assert len(capsys.readouterr().out.splitlines()) == 2
    train(sg.OneDeviceStrategy(), data, epochs=1, verbose=0)
    assert capsys.readouterr().out == ""
    tty = Tty()
    train(sg.OneDeviceStrategy(), data, epochs=1, callbacks=[C.Progress("bar", stream=tty, interval=0.0)])
    text = tty.getvalue()
    assert text.startswith("Epoch 1/1\n") and "\r1/2 [" in text and "ETA: " in text and text.endswith("\n")
    assert "2/2 [========================]" in text


def test_metrics_module_is_importable_as_documented():
    assert metrics.SparseCategoricalAccuracy().name == "sparse_categorical_accuracy"


class Crash(C.Callback):
    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.state.iterations == self.at:
            raise KeyboardInterrupt("simulated interruption")


@pytest.mark.parametrize("kind", ["list", "dataset"])
def test_backup_and_restore_resumes_in_process(tmp_path, kind):
    """Interrupted at every kind of point (mid-epoch, right after an epoch) then resumed: same run."""
    data: Any = global_batches([6, 6, 6, 4])
    if kind == "dataset":
        x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
        data = Dataset.from_tensor_slices((x, y)).shuffle(22, seed=3).batch(6).repeat()
    kw: dict[str, Any] = {"epochs": 3, "steps_per_epoch": 3, "metrics": ["sparse_categorical_accuracy"], "verbose": 0}
    ref_model, ref_hist = train(sg.OneDeviceStrategy(), data, **kw)
    for crash_at in (4, 6):
        backup = tmp_path / f"{kind}-{crash_at}"
        model, opt = build(sg.OneDeviceStrategy())
        with pytest.raises(KeyboardInterrupt):
            fit(model, opt, nn.CrossEntropyLoss(), data, callbacks=[C.BackupAndRestore(backup, save_freq=2), Crash(crash_at)], **kw)
        model, opt = build(sg.OneDeviceStrategy())
        b = C.BackupAndRestore(backup, save_freq=2)
        hist = fit(model, opt, nn.CrossEntropyLoss(), data, callbacks=[b], **kw)
        assert b.restored_from is not None and b.restored_from.endswith(f"ckpt-{crash_at}")
        _assert_same(params_of(model), params_of(ref_model), rtol=0, atol=0)
        assert hist.history == ref_hist.history and hist.epoch == [0, 1, 2]
        assert not list(backup.glob("ckpt-*"))


def test_model_checkpoint_saves_and_restores(tmp_path):
    from stratagem.train import Checkpoint, CheckpointManager

    data, val = global_batches([8, 8]), global_batches([8], seed=5)
    every = C.ModelCheckpoint(tmp_path / "every")
    best = C.ModelCheckpoint(tmp_path / "best", monitor="val_loss", save_best_only=True)
    model, opt = build(sg.OneDeviceStrategy(), lr=5.0)  # a large step: val_loss will not always improve
    hist = fit(model, opt, nn.CrossEntropyLoss(), data, epochs=4, validation_data=val, callbacks=[every, best], verbose=0)
    assert sorted(p.name for p in (tmp_path / "every").iterdir()) == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4"]
    vals = hist.history["val_loss"]
    improved = [i + 1 for i, v in enumerate(vals) if v < min(vals[:i], default=float("inf"))]
    assert sorted(int(p.name[5:]) for p in (tmp_path / "best").iterdir()) == improved
    fresh, _ = build(sg.OneDeviceStrategy())
    assert every.last_path is not None
    CheckpointManager(Checkpoint(model=fresh), tmp_path / "every").restore(every.last_path)  # the model's own strategy
    _assert_same(params_of(fresh), params_of(model), rtol=0, atol=0)


def test_backup_and_restore_skips_a_corrupt_newest_backup(tmp_path):
    data = global_batches([6, 6, 6, 4])
    ref_model, ref_hist = train(sg.OneDeviceStrategy(), data, epochs=2)
    model, opt = build(sg.OneDeviceStrategy())
    with pytest.raises(KeyboardInterrupt):
        fit(model, opt, nn.CrossEntropyLoss(), data, epochs=2, verbose=0, callbacks=[C.BackupAndRestore(tmp_path, save_freq=2), Crash(7)])
    newest = tmp_path / "ckpt-6"
    blob = newest / "shared.safetensors"
    blob.write_bytes(blob.read_bytes()[:-8])  # truncated: its sha256 no longer matches
    model, opt = build(sg.OneDeviceStrategy())
    b = C.BackupAndRestore(tmp_path, save_freq=2)
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        hist = fit(model, opt, nn.CrossEntropyLoss(), data, epochs=2, verbose=0, callbacks=[b])
    assert b.restored_from is not None and b.restored_from.endswith("ckpt-4")
    _assert_same(params_of(model), params_of(ref_model), rtol=0, atol=0)
    assert hist.history == ref_hist.history


def test_tensorboard_as_the_keras_guide_calls_it_writes_epoch_scalars(tmp_path):
    """keras.callbacks.TensorBoard(log_dir, histogram_freq=0, embeddings_freq=0, update_freq="epoch"),
    read back with tensorboard's own reader: the History's values under Keras's tags."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    model = sg.Sequential(nn.Linear(4, 3), nn.Softmax(dim=-1))
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    tb = sg.callbacks.TensorBoard(log_dir=tmp_path / "logs", histogram_freq=0, embeddings_freq=0, update_freq="epoch")
    history = model.fit(x, y, batch_size=16, epochs=2, validation_split=0.25, verbose=0, callbacks=[tb])
    for run, prefix in (("train", ""), ("validation", "val_")):
        events = EventAccumulator(str(tmp_path / "logs" / run))
        events.Reload()
        assert sorted(events.Tags()["scalars"]) == ["epoch_accuracy", "epoch_loss"]
        for name in ("loss", "accuracy"):
            got = [e.value for e in events.Scalars(f"epoch_{name}")]
            assert got == pytest.approx(history.history[prefix + name], rel=1e-6)
    with pytest.raises(ValueError, match="histogram_freq=1 not offered"):
        sg.callbacks.TensorBoard(tmp_path, histogram_freq=1)
