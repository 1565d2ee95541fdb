"""Workers for tests/train/test_keras_model.py: the Keras guide's compile/fit/evaluate/predict/save
program, on one device and on 2 CPU replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg


def digits() -> tuple[np.ndarray, ...]:
    """The guide's MNIST preparation, on scikit-learn's digits (8x8, shipped with the package)."""
    d = load_digits()
    x = (d.data / 16.0).astype("float32")
    y = d.target.astype("float32")
    return x[:1500], y[:1500], x[1500:], y[1500:]


def make_model() -> sg.Sequential:
    return sg.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10), nn.Softmax(dim=-1)
    )


def guide_program(strategy: Any, save_dir: str | None = None) -> dict[str, Any]:
    """compile, fit(x, y, batch_size, validation_split, shuffle), evaluate, predict, save: as a
    Keras user writes it, with the model and its compile inside ``strategy.scope()``."""
    x_train, y_train, x_test, y_test = digits()
    torch.manual_seed(0)
    with strategy.scope():
        model = make_model()
        model.compile(
            optimizer=sg.optimizers.Adam(learning_rate=sg.optimizers.schedules.ExponentialDecay(0.01, 10, 0.9)),
            loss="sparse_categorical_crossentropy",
            metrics=["sparse_categorical_accuracy"],
        )
    history = model.fit(x_train, y_train, batch_size=64, epochs=3, validation_split=0.2, shuffle=True, verbose=0)
    loss, acc = model.evaluate(x_test, y_test, batch_size=128, verbose=0)
    predictions = model.predict(x_test[:3], verbose=0)
    out: dict[str, Any] = {
        "history": dict(history.history),
        "evaluate": [float(loss), float(acc)],
        "predictions": predictions.detach().cpu(),
        "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "iterations": model.optimizer.iterations,  # type: ignore[union-attr]
    }
    if save_dir is not None:
        model.save(Path(save_dir) / "digits_model")
        with strategy.scope():
            again = sg.load_model(Path(save_dir) / "digits_model", model=make_model())
        out["reloaded_evaluate"] = [float(v) for v in again.evaluate(x_test, y_test, batch_size=128, verbose=0)]
    return out


def mirrored_guide(save_dir: str) -> dict[str, Any]:
    return guide_program(sg.MirroredStrategy(devices="cpu", num_replicas=2), save_dir)
