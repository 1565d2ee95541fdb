"""Workers for tests/train/test_keras_metrics.py: a Keras user's program with sample weights,
class weights, metrics / weighted_metrics and a Keras-style custom Metric, on one device and on
2 CPU replicas."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

import stratagem as sg


class CategoricalTruePositives(sg.metrics.Metric):
    """The Keras guide's custom metric ("training_with_built_in_methods"), torch ops for Keras's."""

    def __init__(self, name: str = "categorical_true_positives", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_weight(name="ctp", initializer="zeros")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_pred = torch.reshape(torch.argmax(y_pred, dim=1), (-1, 1))
        values = (y_true.to(torch.int32) == y_pred.to(torch.int32)).to(torch.float32)
        if sample_weight is not None:
            values = values * sample_weight.to(torch.float32)
        self.true_positives.assign_add(torch.sum(values))

    def result(self) -> Any:
        return self.true_positives

    def reset_state(self) -> None:
        self.true_positives.assign(0.0)


class WeightedTruePositives(CategoricalTruePositives):
    """The guide's metric with each example's weight on its own row (the guide's ``(B, 1) * (B,)``
    broadcasts to ``(B, B)``, a sum over pairs that no split of the batch keeps)."""

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        super().update_state(y_true, y_pred, None if sample_weight is None else sample_weight.reshape(-1, 1))


def data() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((90, 5)).astype("float32")  # 90 rows: partial last batches, on 2 replicas too
    y = (rng.random(90) * 3).astype("int64").reshape(-1, 1)
    sw = (rng.random(90) * 3).astype("float32")
    return x, y, sw


def program(strategy: Any) -> dict[str, Any]:
    x, y, sw = data()
    torch.manual_seed(0)
    with strategy.scope():
        model = sg.Sequential(nn.Linear(5, 3), nn.Softmax(dim=-1))
        model.compile(
            optimizer=sg.optimizers.SGD(0.1),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy", CategoricalTruePositives()],
            weighted_metrics=["accuracy", WeightedTruePositives(name="weighted_true_positives")],
        )
    h1 = model.fit(x, y, sample_weight=sw, batch_size=16, epochs=2, shuffle=False, verbose=0,
                   validation_data=(x[:40], y[:40], sw[:40]))
    h2 = model.fit(x, y, class_weight={0: 0.5, 1: 2.0, 2: 1.0}, batch_size=16, epochs=1, shuffle=False, verbose=0)
    evaluated = model.evaluate(x, y, sample_weight=sw, batch_size=32, verbose=0, return_dict=True)
    return {"sample_weight": dict(h1.history), "class_weight": dict(h2.history), "evaluate": evaluated,
            "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


def mirrored_program() -> dict[str, Any]:
    return program(sg.MirroredStrategy(devices="cpu", num_replicas=2))


def custom_loop_metric() -> dict[str, float]:
    """A Keras-style metric updated inside strategy.run: result() is the global value on every replica."""
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    metric = CategoricalTruePositives()
    x, y, _ = data()
    batches = [(torch.from_numpy(x[i : i + 16]), torch.from_numpy(y[i : i + 16])) for i in range(0, 90, 16)]

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        probs = torch.nn.functional.one_hot(yb[:, 0], 3).float()  # right for every row but the first
        probs[:1] = probs[:1].roll(1, dims=1)
        metric.update_state(yb, probs)

    for xb, yb in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(xb, yb))
    total = float(metric.result())
    metric.reset_states()
    return {"total": total, "after_reset": float(metric.result())}


def one_d_regression(strategy: Any) -> dict[str, Any]:
    """1-D labels and a model whose output is 1-D (a Keras regression ending in ``Flatten``-like
    ``squeeze``): 11 examples in global batches of 4 (the last has 3: 2 and 1 on 2 replicas). Keras's mean metrics count
    each batch as one sample there; the answers must not depend on the number of replicas."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 3, generator=g)
    y = torch.randn(11, generator=g)
    with strategy.scope():
        torch.manual_seed(0)
        net = model = sg.Sequential(nn.Linear(3, 1), nn.Flatten(0))
        model.compile(optimizer="sgd", loss="mse", metrics=["mae", "mse", "mape"])
    predictions = net(x).detach()
    mae = sg.metrics.MeanAbsoluteError()
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 11, 4)]

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        mae.update_state(yb, net(xb).detach())

    for xb, yb in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(xb, yb))
    loop = float(mae.result())
    evaluated = model.evaluate(x.numpy(), y.numpy(), batch_size=4, return_dict=True, verbose=0)
    return {"loop_mae": loop, "evaluate": {k: float(v) for k, v in evaluated.items()},
            "predictions": predictions.tolist(), "y": y.tolist()}


def one_d_regression_mirrored() -> dict[str, Any]:
    return one_d_regression(sg.MirroredStrategy(devices="cpu", num_replicas=2))
