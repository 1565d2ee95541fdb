"""Keras's ``MeanAbsolutePercentageError`` metric (issue 30), as the "training and evaluation with
built-in methods" guide writes it (``compile(metrics=[MeanAbsolutePercentageError(), ...])``) and
by its name ``"mape"``. The oracle is Keras 3 itself on its torch backend."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import stratagem as sg  # noqa: E402

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:keras")


def _batches(y_true) -> int:
    # in batches of 4, as fit/evaluate feed it; 1-D labels and predictions in one batch (Keras
    # then counts each batch, not each example, as one sample: see the report of issue 30)
    return 4 if y_true.ndim > 1 else len(y_true)


def _keras(y_true, y_pred, sample_weight=None) -> float:
    m = keras.metrics.MeanAbsolutePercentageError()
    b = _batches(y_true)
    for i in range(0, len(y_true), b):
        w = None if sample_weight is None else sample_weight[i : i + b]
        m.update_state(y_true[i : i + b], y_pred[i : i + b], sample_weight=w)
    return float(m.result())


def _ours(metric, y_true, y_pred, sample_weight=None) -> float:
    b = _batches(y_true)
    for i in range(0, len(y_true), b):
        w = None if sample_weight is None else torch.as_tensor(sample_weight[i : i + b])
        metric.update_state(torch.as_tensor(y_true[i : i + b]), torch.as_tensor(y_pred[i : i + b]), sample_weight=w)
    return float(metric.result())


@pytest.mark.parametrize("shape", [(10,), (10, 1), (10, 3)])
def test_mape_matches_keras(shape):
    rng = np.random.default_rng(0)
    y_true = rng.normal(size=shape).astype("float32")
    y_true[0] = 0.0  # |y_true| below epsilon: divided by Keras's 1e-7
    y_pred = rng.normal(size=shape).astype("float32")
    weights = rng.uniform(0.1, 2.0, size=shape[0]).astype("float32")

    metric = sg.metrics.MeanAbsolutePercentageError()
    assert metric.name == "mean_absolute_percentage_error"
    want = _keras(y_true, y_pred)
    assert want > 1e6  # the zero label dominates, as in Keras
    np.testing.assert_allclose(_ours(metric, y_true, y_pred), want, rtol=1e-5)
    if len(shape) > 1:  # Keras cannot weight 1-D labels and predictions (a scalar per batch)
        metric.reset_state()
        np.testing.assert_allclose(_ours(metric, y_true, y_pred, weights), _keras(y_true, y_pred, weights), rtol=1e-5)

    y_true = np.abs(y_true) + 0.5  # an ordinary case
    np.testing.assert_allclose(_ours(sg.metrics.get("mape"), y_true, y_pred), _keras(y_true, y_pred), rtol=1e-5)


def test_mape_by_name_in_compile_logs_as_keras():
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True) + 3.0
    model = sg.Sequential(nn.Linear(4, 1))
    km = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    km.layers[0].set_weights([model[0].weight.detach().numpy().T, model[0].bias.detach().numpy()])
    km.compile(optimizer="sgd", loss="mse", metrics=["mape", keras.metrics.MeanAbsolutePercentageError()])
    want = km.evaluate(x.numpy(), y.numpy(), batch_size=8, verbose=0, return_dict=True)

    model.compile(optimizer="sgd", loss="mse", metrics=["mape", sg.metrics.MeanAbsolutePercentageError()])
    got = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert set(want) == set(got) == {"loss", "mape", "mean_absolute_percentage_error"}
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5)
