"""fit's lean step: metrics updated once per execution and a loss module's own mean give the
same totals, logs and parameters as one update per step and per-example losses."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.train.execution_metrics import ExecutionMetrics
from stratagem.train.metrics import (
    KerasAccuracy,
    Mean,
    Metric,
    SparseCategoricalAccuracy,
    TopKCategoricalAccuracy,
)

fit_module = sys.modules["stratagem.train.fit"]


class MeanOfBatchMaxima(Metric):
    """Not additive: its value depends on where the batches end."""

    def batch_totals(self, y_true, y_pred, sample_weight=None):
        return torch.stack((y_pred.max().double(), torch.ones((), dtype=torch.float64)))


def _steps(sizes, *, weights=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        y = torch.randint(0, 5, (n,), generator=g)
        logits = torch.randn(n, 5, generator=g)
        losses = torch.rand(n, generator=g)
        sw = torch.rand(n, generator=g) if weights else None
        out.append((y, logits, losses, sw))
    return out


def _metrics():
    return [SparseCategoricalAccuracy(), KerasAccuracy(), TopKCategoricalAccuracy(k=2), MeanOfBatchMaxima("maxima")]


@pytest.mark.parametrize("sizes", [[8, 8, 8, 3], [4], [6, 6, 2, 6, 6]])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("max_elements", [1 << 22, 40])
def test_kept_updates_give_the_totals_of_one_update_per_step(sizes, weights, max_elements):
    steps = _steps(sizes, weights=weights)
    per_step_loss, per_step = Mean("loss"), _metrics()
    for y, logits, losses, sw in steps:
        per_step_loss.update_state(losses)
        for m in per_step:
            m.update_state(y, logits, sample_weight=sw)
    kept_loss, kept = Mean("loss"), _metrics()
    record = ExecutionMetrics(kept_loss, kept, max_elements=max_elements)
    for y, logits, losses, sw in steps:
        record.add_losses(losses)
        record.add(y, logits, sw)
    record.apply()
    torch.testing.assert_close(kept_loss.local_totals(), per_step_loss.local_totals(), rtol=1e-12, atol=1e-12)
    for a, b in zip(kept, per_step):
        torch.testing.assert_close(a.local_totals(), b.local_totals(), rtol=1e-12, atol=1e-12, msg=a.name)


def test_mean_losses_count_each_example():
    loss = Mean("loss")
    record = ExecutionMetrics(loss, [])
    record.add_mean_loss(torch.tensor(2.0), 4)
    record.add_mean_loss(torch.tensor(1.0), 4)
    record.add_mean_loss(torch.tensor(5.0), 2)  # a partial last batch
    record.add_losses(torch.tensor([1.0, 3.0]))
    record.apply()
    assert loss.local_totals().tolist() == [2 * 4 + 1 * 4 + 5 * 2 + 4.0, 12.0]


def test_nested_predictions_are_applied_per_step():
    seen = []

    class Recording(SparseCategoricalAccuracy):
        def batch_totals(self, y_true, y_pred, sample_weight=None):
            seen.append(int(y_true.shape[0]))
            return super().batch_totals(y_true, y_pred["logits"], sample_weight)

    m = Recording()
    record = ExecutionMetrics(Mean("loss"), [m])
    for y, logits, _, _ in _steps([3, 3]):
        record.add(y, {"logits": logits}, None)
    record.apply()
    assert seen == [3, 3]
    assert m.local_totals()[1].item() == 6


def _fit_params(loss_fn, data, spe, model_fn, metrics=("accuracy",)):
    torch.manual_seed(0)
    strategy = sg.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = model_fn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = sg.fit(model, opt, loss_fn, data, epochs=2, metrics=list(metrics), verbose=0,
                     steps_per_execution=spe)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, history.history


def _classification(n_batches=5, last=3):
    g = torch.Generator().manual_seed(1)
    sizes = [8] * (n_batches - 1) + [last]
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in sizes]


def _regression(n_batches=4, last=5):
    g = torch.Generator().manual_seed(2)
    sizes = [8] * (n_batches - 1) + [last]
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 3, 4, generator=g)) for n in sizes]


@pytest.mark.parametrize("spe", [1, 3, "auto"])
@pytest.mark.parametrize(
    "case",
    [
        ("cross_entropy", nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="none"), _classification,
         lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)), ["accuracy", "top_k_categorical_accuracy"]),
        ("mse_3d", nn.MSELoss(), nn.MSELoss(reduction="none"), _regression,
         lambda: nn.Sequential(nn.Linear(6, 12), nn.Unflatten(1, (3, 4))), ["mse", "mae"]),
    ],
    ids=lambda c: c[0] if isinstance(c, tuple) else str(c),
)
def test_a_loss_modules_mean_trains_as_its_per_example_losses(case, spe):
    """The fused path (the module's own mean) against the per-example path (reduction='none'),
    with a partial last batch: same parameters and the same logged loss and metrics."""
    _, mean_loss, none_loss, data_fn, model_fn, metrics = case
    data = data_fn()
    fused, h_fused = _fit_params(mean_loss, data, spe, model_fn, metrics)
    general, h_general = _fit_params(none_loss, data, spe, model_fn, metrics)
    for k in general:
        torch.testing.assert_close(fused[k], general[k], rtol=1e-5, atol=1e-6, msg=k)
    for key in h_general:
        assert h_fused[key] == pytest.approx(h_general[key], rel=1e-5), key


def test_one_update_per_step_gives_the_same_logs_as_one_per_execution():
    data = _classification(7, 5)

    def model_fn():
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))

    p1, h1 = _fit_params(nn.CrossEntropyLoss(), data, 1, model_fn)
    p7, h7 = _fit_params(nn.CrossEntropyLoss(), data, 7, model_fn)
    for k in p1:
        torch.testing.assert_close(p1[k], p7[k], rtol=0, atol=0)
    for key in h1:
        assert h1[key] == pytest.approx(h7[key], rel=1e-12), key


def test_auto_steps_per_execution_keeps_the_fixed_cost_under_one_percent():
    cadence = fit_module._Cadence("auto", [])
    assert cadence.size == 1 and cadence.measuring
    assert cadence.proposal(0.002, 0.001, 1) == []  # nothing measured yet
    cadence.timed(1, seconds=0.0015, in_steps=0.001, sync=0.0005)  # 1 ms step, 1 ms fixed
    assert cadence.proposal(0.0011, 0.001, 1) == [100.0]  # 1 ms / (1% of 1 ms)
    cadence.agreed([100.0 + 101.0], replicas=2)  # the mean of two replicas' proposals, rounded up
    assert cadence.size == 101 and not cadence.measuring

    slow = fit_module._Cadence("auto", [])
    slow.timed(1, seconds=0.0502, in_steps=0.05, sync=0.0003)  # a 50 ms step keeps a log per step
    slow.agreed(slow.proposal(0.0502, 0.05, 1), replicas=1)
    assert slow.size == 1

    tiny = fit_module._Cadence("auto", [])
    tiny.timed(1, seconds=0.01, in_steps=1e-6, sync=0.01)
    tiny.agreed(tiny.proposal(0.01, 1e-6, 1), replicas=1)
    assert tiny.size == fit_module.AUTO_MAX_STEPS_PER_EXECUTION

    class PerBatch(sg.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    assert not fit_module._Cadence("auto", [PerBatch()]).measuring  # logs every batch: 1 step
    with pytest.raises(ValueError, match="steps_per_execution must be a positive"):
        fit_module._Cadence(0, [])


def test_metric_copies_are_made_only_for_validation():
    m = SparseCategoricalAccuracy()
    data = _classification(2, 8)
    strategy = sg.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = nn.Linear(6, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = sg.fit(model, opt, nn.CrossEntropyLoss(), data, metrics=[m], validation_data=data, verbose=0)
    assert set(h.history) == {"loss", "sparse_categorical_accuracy", "val_loss", "val_sparse_categorical_accuracy"}
    # the validation copy counted the validation data alone (16 examples), not the training's too
    assert sg.evaluate(model, nn.CrossEntropyLoss(), data, metrics=["sparse_categorical_accuracy"], return_dict=True) == pytest.approx(
        {"loss": h.history["val_loss"][-1], "sparse_categorical_accuracy": h.history["val_sparse_categorical_accuracy"][-1]})
