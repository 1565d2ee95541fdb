"""The five TensorFlow tutorials of examples/tutorials run as written, on small data made in code."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from stratagem.testing import assert_clean_run, run_script

TUTORIALS = Path(__file__).resolve().parents[1] / "examples" / "tutorials"


def _run(name: str, tmp_path: Path, timeout: float, launcher: tuple[str, ...] = ()):
    env = {**os.environ, "CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    env.pop("TF_CONFIG", None)
    r = run_script([*launcher, str(TUTORIALS / name)], timeout=timeout, env=env)
    assert_clean_run(r, what=name)
    return r.stdout


def _numbers(line: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?\d+\.?\d*(?:e-?\d+)?", line)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_custom_training_loop_tutorial(tmp_path, monkeypatch):
    out = _run("custom_training.py", tmp_path / "two", 200)
    lines = [line for line in out.splitlines() if line.startswith(("Epoch", "Accuracy after"))]
    epochs = re.findall(r"Epoch (\d), Loss: [\d.]+, Accuracy: [\d.]+, Test Loss: [\d.]+, Test Accuracy: ([\d.]+)", out)
    assert [e for e, _ in epochs] == ["1", "2", "3", "4"], out  # printed once, by the chief
    assert float(epochs[-1][1]) > 70, out  # it learns
    # the restored checkpoint is the last one saved (ckpt-2, after epoch 3): its test accuracy
    restored = re.search(r"Accuracy after restoring the saved model without strategy: ([\d.]+)", out)
    assert restored is not None and float(restored.group(1)) == pytest.approx(float(epochs[2][1]))
    assert sorted(os.listdir(tmp_path / "two" / "ckpt")) == ["ckpt-1", "ckpt-2"]  # TF's ckpt-1, ckpt-2
    assert len(lines) == 4 + 1 + 4 + 4, out  # the training loop, the restore, iterators, epoch function
    # the reference: the same program on one device (the same global batches); every number it prints
    monkeypatch.setenv("NUM_REPLICAS", "1")
    single = _run("custom_training.py", tmp_path / "one", 200)
    assert "Number of devices: 1" in single
    ref = [line for line in single.splitlines() if line.startswith(("Epoch", "Accuracy after"))]
    assert len(ref) == len(lines)
    for a, b in zip(lines, ref):
        assert _numbers(a) == pytest.approx(_numbers(b), rel=1e-4, abs=1e-4), (a, b)


@pytest.mark.timeout(90)
def test_keras_distributed_training_tutorial(tmp_path):
    out = _run("keras_distributed.py", tmp_path, 80)
    lrs = re.findall(r"Learning rate for epoch (\d) is ([\de.-]+)", out)
    assert [(e, float(lr)) for e, lr in lrs] == [("1", 1e-3), ("2", 1e-3), ("3", 1e-3), ("4", 1e-4)], out
    acc = re.search(r"Eval loss: [\d.]+, Eval accuracy: ([\d.]+)", out)
    assert acc is not None and float(acc.group(1)) > 0.8, out
    assert (tmp_path / "ckpt" / "training.csv").read_text().count("\n") == 5  # header + 4 epochs


@pytest.mark.timeout(90)
def test_multi_worker_tf_config_tutorial(tmp_path):
    out = _run("multi_worker_tf_config.py", tmp_path, 80)  # starts 2 workers, each with TF_CONFIG
    m = re.findall(r"workers=(\d) accuracy=([\d.]+)", out)
    assert len(m) == 1 and m[0][0] == "2" and float(m[0][1]) > 0.8, out


@pytest.mark.timeout(60)
def test_data_performance_guide(tmp_path):
    out = _run("data_performance.py", tmp_path, 50)
    speedups = dict(re.findall(r"(\w[\w ]*?) ([\d.]+)x", out.splitlines()[-1]))
    assert set(speedups) == {"prefetch", "parallel interleave", "parallel map", "cache", "vectorized map"}, out
    # the techniques whose gain does not depend on idle cores: reading a cache, one call per batch
    assert float(speedups["cache"]) > 1.5 and float(speedups["vectorized map"]) > 2, out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_parameter_server_training_tutorial(tmp_path):
    pytest.importorskip("cloudpickle")
    # as its docstring says: a chief, 2 workers and 1 ps task on this machine
    launcher = ("-m", "stratagem", "run", "--workers", "2", "--ps", "1")
    out = _run("parameter_server_training.py", tmp_path, 220, launcher)
    fit_losses = [float(v) for v in re.search(r"fit: loss per epoch (.*)", out).group(1).split(", ")]
    assert len(fit_losses) == 5 and fit_losses[-1] < 0.1 * fit_losses[0], out
    epochs = re.findall(r"Finished epoch (\d), accuracy is ([\d.]+)\.", out)
    assert [e for e, _ in epochs] == ["0", "1", "2", "3"] and float(epochs[-1][1]) > 0.9, out
    # the tutorial's form: `accuracy`, made in scope, is updated in the scheduled replica_fn on the
    # workers and read on the chief: each epoch counts its 5 steps of 32 examples exactly once
    for _, acc in epochs:
        assert float(acc) * 160 == pytest.approx(round(float(acc) * 160), abs=1e-3), out
    assert float(re.search(r"Final loss is ([\d.]+)", out).group(1)) < 0.3, out
    assert float(re.search(r"Evaluation accuracy: ([\d.]+)", out).group(1)) > 0.9, out
    assert "ckpt-5" in os.listdir(tmp_path / "ckpt" / "ckpt")  # ModelCheckpoint, written by the chief


# --- Keras's guide "Training & evaluation with the built-in methods", against Keras 3 itself -------
def _guide_lines(out: str) -> dict[str, object]:
    """The ``tag: value`` lines the guide's port prints (Python literals)."""
    import ast

    found: dict[str, object] = {}
    for line in out.splitlines():
        tag, sep, value = line.partition(": ")
        if sep and value[:1] in "[{(":
            try:
                found[tag] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                continue
    return found


def _keras_digits_model(keras):
    """The port's get_uncompiled_model() in Keras, with its initial weights (torch.manual_seed(0))."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    linears = [nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10)]
    inputs = keras.Input(shape=(64,), name="digits")
    x = keras.layers.Dense(64, activation="relu", name="dense_1")(inputs)
    x = keras.layers.Dense(64, activation="relu", name="dense_2")(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="predictions")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    for layer, lin in zip(model.layers[1:], linears):
        layer.set_weights([lin.weight.detach().numpy().T, lin.bias.detach().numpy()])
    return model


def _keras_guide_numbers() -> dict[str, object]:
    """The guide's array sections run by Keras 3 (torch backend), unshuffled as the port runs them."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "torch":  # pragma: no cover - another backend chosen by the caller
        pytest.skip("compares with Keras on its torch backend")
    import numpy as np
    from sklearn.datasets import load_digits

    d = load_digits()
    x_train, x_test = d.data[:1500].astype("float32") / 16, d.data[1500:].astype("float32") / 16
    y_train, y_test = d.target[:1500].astype("float32"), d.target[1500:].astype("float32")
    x_val, y_val, x_train, y_train = x_train[-300:], y_train[-300:], x_train[:-300], y_train[:-300]
    ref: dict[str, object] = {}

    def compiled(**kw):
        model = _keras_digits_model(keras)
        model.compile(**{"optimizer": "rmsprop", "loss": "sparse_categorical_crossentropy",
                         "metrics": ["sparse_categorical_accuracy"], **kw})
        return model

    model = compiled(optimizer=keras.optimizers.RMSprop(), loss=keras.losses.SparseCategoricalCrossentropy(),
                     metrics=[keras.metrics.SparseCategoricalAccuracy()])
    h = model.fit(x_train, y_train, batch_size=64, epochs=2, validation_data=(x_val, y_val), shuffle=False, verbose=0)
    ref["history.history"] = h.history
    ref["test loss, test acc"] = model.evaluate(x_test, y_test, batch_size=128, verbose=0)
    ref["predictions"] = model.predict(x_test[:3], verbose=0)

    one_hot = np.eye(10, dtype="float32")[y_train.astype(int)]

    def custom_mean_squared_error(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred))

    class CustomMSE(keras.losses.Loss):
        def __init__(self, regularization_factor=0.1, name="custom_mse"):
            super().__init__(name=name)
            self.regularization_factor = regularization_factor

        def call(self, y_true, y_pred):
            mse = keras.ops.mean(keras.ops.square(y_true - y_pred))
            reg = keras.ops.mean(keras.ops.square(0.5 - y_pred))
            return mse + reg * self.regularization_factor

    class CategoricalTruePositives(keras.metrics.Metric):
        def __init__(self, name="categorical_true_positives", **kwargs):
            super().__init__(name=name, **kwargs)
            self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

        def update_state(self, y_true, y_pred, sample_weight=None):
            y_pred = keras.ops.reshape(keras.ops.argmax(y_pred, axis=1), (-1, 1))
            values = keras.ops.cast(keras.ops.reshape(y_true, (-1, 1)), "int32") == keras.ops.cast(y_pred, "int32")
            self.true_positives.assign_add(keras.ops.sum(keras.ops.cast(values, "float32")))

        def result(self):
            return self.true_positives

        def reset_state(self):
            self.true_positives.assign(0.0)

    for tag, loss in [("custom_mean_squared_error", custom_mean_squared_error), ("CustomMSE", CustomMSE())]:
        model = compiled(optimizer=keras.optimizers.Adam(), loss=loss, metrics=None)
        ref[tag] = model.fit(x_train, one_hot, batch_size=64, epochs=1, shuffle=False, verbose=0).history
    model = compiled(optimizer=keras.optimizers.RMSprop(learning_rate=1e-3), metrics=[CategoricalTruePositives()])
    ref["CategoricalTruePositives"] = model.fit(x_train, y_train, batch_size=64, epochs=3, shuffle=False, verbose=0).history
    ref["validation_split"] = compiled().fit(
        x_train, y_train, batch_size=64, validation_split=0.2, epochs=1, shuffle=False, verbose=0).history
    class_weight = {i: 2.0 if i == 5 else 1.0 for i in range(10)}
    ref["class_weight"] = compiled().fit(
        x_train, y_train, class_weight=class_weight, batch_size=64, epochs=1, shuffle=False, verbose=0).history
    sample_weight = np.where(y_train == 5, 2.0, 1.0)
    ref["sample_weight"] = compiled().fit(
        x_train, y_train, sample_weight=sample_weight, batch_size=64, epochs=1, shuffle=False, verbose=0).history
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=1e-2, patience=2, verbose=0)
    ref["EarlyStopping"] = compiled().fit(x_train, y_train, epochs=20, batch_size=64, callbacks=[stop],
                                          validation_split=0.2, shuffle=False, verbose=0).history

    class LossHistory(keras.callbacks.Callback):
        def on_train_begin(self, logs):
            self.per_batch_losses = []

        def on_batch_end(self, batch, logs):
            self.per_batch_losses.append(logs.get("loss"))

    loss_history = LossHistory()
    compiled().fit(x_train, y_train, batch_size=64, epochs=1, callbacks=[loss_history], shuffle=False, verbose=0)
    ref["per_batch_losses"] = loss_history.per_batch_losses
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=100000, decay_rate=0.96, staircase=True)
    ref["ExponentialDecay"] = compiled(optimizer=keras.optimizers.RMSprop(learning_rate=schedule)).fit(
        x_train, y_train, batch_size=64, epochs=1, shuffle=False, verbose=0).history
    return ref


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Keras's own numpy-2 deprecation on its torch backend
def test_keras_builtin_methods_guide(tmp_path):
    import numpy as np

    out = _run("keras_builtin_methods.py", tmp_path, 200)
    ours = _guide_lines(out)
    ref = _keras_guide_numbers()

    def close(tag, tol=2e-5):
        a, b = ours[tag], ref[tag]
        if isinstance(b, dict):
            assert sorted(a) == sorted(b), (tag, list(a), list(b))  # the same logs
            for k in b:
                np.testing.assert_allclose(a[k], b[k], rtol=tol, atol=tol, err_msg=f"{tag}: {k}")
        else:
            np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=tol, atol=tol,
                                       err_msg=tag)

    for tag in ["history.history", "test loss, test acc", "predictions", "custom_mean_squared_error", "CustomMSE",
                "CategoricalTruePositives", "validation_split", "EarlyStopping", "per_batch_losses"]:
        close(tag)
    assert "predictions shape: (3, 10)" in out
    assert len(ours["EarlyStopping"]["loss"]) == len(ref["EarlyStopping"]["loss"])  # stopped at Keras's epoch
    # class_weight / sample_weight: the loss is Keras's (sum of w * loss / batch size); the metric
    # of compile(metrics=) is weighted in stratagem, unweighted in Keras
    for tag in ["class_weight", "sample_weight"]:
        np.testing.assert_allclose(ours[tag]["loss"], ref[tag]["loss"], rtol=2e-5, err_msg=tag)
    assert ours["class_weight"] == ours["sample_weight"]  # class_weight is a sample weight per class
    # lr 0.1 on RMSprop: chaotic, compared loosely
    np.testing.assert_allclose(ours["ExponentialDecay"]["loss"], ref["ExponentialDecay"]["loss"], rtol=0.05)

    # the dataset sections: the same seeded shuffle gives the same first epoch, and
    # validation_steps=2 validates on the first 2 batches only
    assert ours["Dataset"]["loss"][0] == ours["validation_data=val_dataset"]["loss"][0]
    assert ours["validation_steps"]["val_loss"] != ours["validation_data=val_dataset"]["val_loss"]
    assert list(ours["evaluate(test_dataset)"]) == ["loss", "sparse_categorical_accuracy"]
    assert len(ours["steps_per_epoch"]["loss"]) == 3 and ours["LogisticEndpoint"]["loss"][0] > 0
    for tag in ["multi-output lists", "multi-output dicts", "multi-output Dataset"]:
        assert list(ours[tag])[0] == "loss" and np.isfinite(ours[tag]["loss"][0]), tag  # (+ per-output logs)
    # ModelCheckpoint's Keras filepaths: the best epochs and every 10 batches (38 batches of 32)
    assert {"mymodel_1.keras", "mymodel_2.keras"} <= set(os.listdir(tmp_path / "ckpt"))
    assert "Creating a new model" in out and "Restoring from" in out
    assert len(ours["checkpoints"]) == 7 and ours["checkpoints"][0] == "checkpoint"
