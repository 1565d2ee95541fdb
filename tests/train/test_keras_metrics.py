"""Keras's metric semantics in fit / evaluate (issue 30): ``metrics=`` unweighted and
``weighted_metrics=`` weighted (sample_weight and class_weight), Keras's log names (per output,
``weighted_`` prefixes), Keras-style custom ``Metric`` subclasses (``add_weight`` /
``update_state`` / ``result``) summed across replicas, ``reset_states``, and torch LR schedulers
stepped per batch. The oracle is Keras 3 itself on its torch backend, from the same weights."""

from __future__ import annotations

import math
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from keras_metrics_workers import (  # noqa: E402
    CategoricalTruePositives,
    custom_loop_metric,
    data,
    mirrored_program,
    program,
)
from torch import nn  # noqa: E402

import stratagem as sg  # noqa: E402
from stratagem.testing import run_workers  # noqa: E402

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:keras")
if keras.backend.backend() != "torch":  # pragma: no cover - another backend chosen by the caller
    pytest.skip("these tests compare with Keras on its torch backend", allow_module_level=True)
from keras import ops  # noqa: E402


class KerasCategoricalTruePositives(keras.metrics.Metric):
    """The guide's metric as Keras's own users write it (the oracle's copy)."""

    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = ops.reshape(ops.argmax(y_pred, axis=1), (-1, 1))
        values = ops.cast(ops.cast(y_true, "int32") == ops.cast(y_pred, "int32"), "float32")
        if sample_weight is not None:
            values = ops.multiply(values, ops.cast(sample_weight, "float32"))
        self.true_positives.assign_add(ops.sum(values))

    def result(self):
        return self.true_positives

    def reset_state(self):
        self.true_positives.assign(0.0)


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=tol, atol=tol)


def _pair():
    """A Keras softmax classifier and the same one in torch, with the same initial weights."""
    keras.utils.set_random_seed(0)
    km = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="softmax")])
    model = sg.Sequential(nn.Linear(5, 3), nn.Softmax(dim=-1))
    with torch.no_grad():
        k, b = km.layers[0].get_weights()
        model[0].weight.copy_(torch.from_numpy(k.T))
        model[0].bias.copy_(torch.from_numpy(b))
    return km, model


def _same_history(got, want):
    assert list(got) == list(want)  # Keras's names, in Keras's (sorted) order
    for key in want:
        _close(got[key], want[key])


@pytest.mark.parametrize("weights", ["sample_weight", "class_weight"])
def test_metrics_are_unweighted_and_weighted_metrics_weighted_as_in_keras(weights):
    x, y, sw = data()
    km, model = _pair()
    kw = {"sample_weight": sw} if weights == "sample_weight" else {"class_weight": {0: 0.5, 1: 2.0, 2: 1.0}}
    runs = []
    for m, opt, ctp in [(km, keras.optimizers.SGD(0.1), KerasCategoricalTruePositives),
                        (model, sg.optimizers.SGD(0.1), CategoricalTruePositives)]:
        # the same metric in both lists: Keras logs the weighted one as weighted_<name>
        m.compile(optimizer=opt, loss="sparse_categorical_crossentropy",
                  metrics=["acc", ctp()], weighted_metrics=["acc", ctp()])
        h = m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, **kw)
        ev = m.evaluate(x, y, sample_weight=sw, batch_size=32, verbose=0)
        ev_dict = m.evaluate(x, y, sample_weight=sw, batch_size=32, verbose=0, return_dict=True)
        runs.append((h.history, ev, ev_dict))
    (kh, ke, kd), (sh, se, sd) = runs
    assert set(kh) == {"loss", "acc", "categorical_true_positives", "weighted_acc",
                       "weighted_categorical_true_positives"}
    _same_history(sh, kh)
    assert len(se) == len(ke) == 7  # Keras lists a name found twice twice (its _flatten_metrics_in_order)
    _close(se, ke)  # evaluate's list in Keras's order
    assert list(sd) == list(kd)
    _close(list(sd.values()), list(kd.values()))
    assert sh["acc"] != sh["weighted_acc"]  # the weights do change the weighted one


def test_functional_fit_and_evaluate_take_weighted_metrics():
    """sg.fit / sg.evaluate: the same rule (the issue's repro: 0.375 unweighted, as Keras)."""
    x, y, sw = data()
    _, model = _pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [tuple(torch.from_numpy(a[i : i + 16]) for a in (x, y[:, 0], sw)) for i in range(0, 90, 16)]
    loss = sg.losses.SparseCategoricalCrossentropy()
    acc, wacc = sg.metrics.SparseCategoricalAccuracy(), sg.metrics.SparseCategoricalAccuracy()
    with torch.no_grad():
        preds = model(torch.from_numpy(x)).argmax(-1).numpy()
    hit = (preds == y[:, 0]).astype("float64")
    ev = sg.evaluate(model, loss, batches, metrics=[acc], weighted_metrics=[wacc], return_dict=True)
    assert list(ev) == ["loss", "sparse_categorical_accuracy", "weighted_sparse_categorical_accuracy"]
    _close(ev["sparse_categorical_accuracy"], hit.mean(), 1e-12)
    _close(ev["weighted_sparse_categorical_accuracy"], (hit * sw).sum() / sw.sum(), 1e-6)
    h = sg.fit(model, opt, loss, batches, metrics=["sparse_categorical_accuracy"], verbose=0)
    assert list(h.history) == ["loss", "sparse_categorical_accuracy"]


def test_per_output_metrics_and_losses_are_logged_as_keras_logs_them():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 5)).astype("float32")
    ya, yb = (rng.random(48) * 3).astype("int64"), rng.standard_normal((48, 1)).astype("float32")
    sw = (rng.random(48) * 3).astype("float32")
    keras.utils.set_random_seed(0)
    inp = keras.Input((5,))
    km = keras.Model(inp, {"out_a": keras.layers.Dense(3, activation="softmax", name="out_a")(inp),
                           "out_b": keras.layers.Dense(1, name="out_b")(inp)})

    class TwoHeads(sg.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 3), nn.Linear(5, 1)

        def forward(self, x):
            return {"out_a": torch.softmax(self.a(x), -1), "out_b": self.b(x)}

    model = TwoHeads()
    with torch.no_grad():
        for lin, name in ((model.a, "out_a"), (model.b, "out_b")):
            k, b = km.get_layer(name).get_weights()
            lin.weight.copy_(torch.from_numpy(k.T))
            lin.bias.copy_(torch.from_numpy(b))
    runs = []
    for m, opt in [(km, keras.optimizers.SGD(0.1)), (model, sg.optimizers.SGD(0.1))]:
        m.compile(optimizer=opt, loss={"out_a": "sparse_categorical_crossentropy", "out_b": "mse"},
                  loss_weights={"out_a": 1.0, "out_b": 0.5},
                  metrics={"out_a": ["accuracy", "accuracy"], "out_b": ["mae"]},
                  weighted_metrics={"out_a": ["accuracy"], "out_b": ["mae"]})
        h = m.fit(x, {"out_a": ya, "out_b": yb}, sample_weight=sw, batch_size=16, epochs=2, shuffle=False,
                  verbose=0, validation_split=0.25)
        ev = m.evaluate(x, {"out_a": ya, "out_b": yb}, sample_weight=sw, batch_size=16, verbose=0)
        runs.append((h.history, ev))
    (kh, ke), (sh, se) = runs
    assert {"out_a_accuracy", "out_a_accuracy_1", "out_a_weighted_accuracy", "out_b_mae", "out_b_weighted_mae",
            "out_a_loss", "out_b_loss", "val_out_b_loss"} <= set(kh)
    _same_history(sh, kh)
    _close(se, ke)


def test_a_keras_style_metric_is_summed_across_replicas_and_reset_states_resets_it():
    got = [r.value for r in run_workers(custom_loop_metric, 2, timeout=120)]
    for g in got:  # 6 global batches, each split in 2: each replica half's first row is wrong
        assert g == {"total": 90.0 - 12, "after_reset": 0.0}
    m = CategoricalTruePositives()
    m.update_state(torch.tensor([[1], [2]]), torch.tensor([[0.1, 0.9, 0.0], [0.0, 0.0, 1.0]]))
    assert float(m.result()) == 2.0 and m.variables[0].name == "ctp"
    m.reset_states()  # TF 2's name
    assert float(m.result()) == 0.0
    assert CategoricalTruePositives.default_name == "categorical_true_positives"


def test_weighted_metrics_under_mirrored_strategy_equal_one_device():
    want = program(sg.OneDeviceStrategy("cpu"))
    got = [r.value for r in run_workers(mirrored_program, 2, timeout=240)]
    for g in got:
        for part in ("sample_weight", "class_weight"):
            assert list(g[part]) == list(want[part])
            for key in want[part]:
                _close(g[part][key], want[part][key], tol=1e-5)
        assert list(g["evaluate"]) == list(want["evaluate"])
        _close(list(g["evaluate"].values()), list(want["evaluate"].values()), tol=1e-5)
        for k in want["params"]:
            _close(g["params"][k], want["params"][k], tol=1e-5)
    assert "weighted_true_positives" in want["sample_weight"]


def _get_lr(it, warmup=4, decay=20, lr=0.1, min_lr=0.01):
    """nanoGPT's get_lr: linear warmup, then cosine decay to min_lr."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    ratio = (it - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def test_a_torch_scheduler_is_stepped_per_batch_when_asked():
    """fit(lr_scheduler=LambdaLR(...), lr_scheduler_interval="step") equals nanoGPT's loop, which
    sets the learning rate before every iteration."""
    x, y, _ = data()
    batches = [(torch.from_numpy(x[i : i + 8]), torch.from_numpy(y[i : i + 8, 0])) for i in range(0, 88, 8)]
    loss_fn = nn.CrossEntropyLoss()

    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, opt = fresh()  # the hand-written loop
    lrs = []
    for it, (xb, yb) in enumerate(batches * 2):
        for group in opt.param_groups:
            group["lr"] = _get_lr(it)
        lrs.append(_get_lr(it))
        opt.zero_grad()
        loss_fn(model(xb), yb).backward()
        opt.step()
    fitted, fopt = fresh()
    sched = torch.optim.lr_scheduler.LambdaLR(fopt, lambda it: _get_lr(it) / 0.1)
    sg.fit(fitted, fopt, loss_fn, batches, epochs=2, verbose=0, lr_scheduler=sched, lr_scheduler_interval="step",
           steps_per_execution=4)
    for a, b in zip(model.parameters(), fitted.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert sched.last_epoch == 22
    # "epoch" (the default): stepped after each epoch, as the hand-written loop halving it per epoch
    model, opt = fresh()
    for epoch in range(2):
        for group in opt.param_groups:
            group["lr"] = 0.1 * 0.5**epoch
        for xb, yb in batches:
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()
    fitted, fopt = fresh()
    sched = torch.optim.lr_scheduler.StepLR(fopt, step_size=1, gamma=0.5)
    sg.fit(fitted, fopt, loss_fn, batches, epochs=2, verbose=0, lr_scheduler=sched)
    for a, b in zip(model.parameters(), fitted.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert fopt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_clear_errors():
    _, model = _pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(4, 5), torch.randint(0, 3, (4,)))]
    acc = sg.metrics.SparseCategoricalAccuracy()
    with pytest.raises(ValueError, match="given twice"):
        sg.fit(model, opt, nn.CrossEntropyLoss(), batches, metrics=[acc], weighted_metrics=[acc], verbose=0)
    with pytest.raises(ValueError, match="ReduceLROnPlateau needs a monitored value"):
        sg.fit(model, opt, nn.CrossEntropyLoss(), batches, verbose=0,
               lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(ValueError, match="'step' .* or 'epoch'"):
        sg.fit(model, opt, nn.CrossEntropyLoss(), batches, verbose=0,
               lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1), lr_scheduler_interval="batch")
    with pytest.raises(ValueError, match="Expected `weighted_metrics` argument to be a list"):
        model.compile("sgd", "sparse_categorical_crossentropy", weighted_metrics="accuracy")


def test_lambda_callback_as_keras_writes_it():
    """keras.callbacks.LambdaCallback: its batch hook runs after every batch, even when fit
    would otherwise run several steps per execution."""
    _, model = _pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(5)]
    seen = {"batches": [], "epochs": [], "end": 0}
    cb = sg.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen["batches"].append(batch),
        on_epoch_end=lambda epoch, logs: seen["epochs"].append(sorted(logs)),
        on_train_end=lambda logs: seen.__setitem__("end", seen["end"] + 1),
    )
    sg.fit(model, opt, nn.CrossEntropyLoss(), batches, epochs=2, callbacks=[cb], verbose=0)
    assert seen == {"batches": [0, 1, 2, 3, 4] * 2, "epochs": [["loss"], ["loss"]], "end": 1}
    with pytest.raises(ValueError, match="'on_step' is not a callback hook"):
        sg.callbacks.LambdaCallback(on_step=print)


@pytest.mark.timeout(240)
def test_mean_metrics_on_1d_outputs_count_batches_as_keras_does_on_any_number_of_replicas():
    """Keras's MeanAbsoluteError / MeanSquaredError / MAPE on 1-D labels and 1-D predictions
    average per batch and count the batch as one sample (a smaller last batch weighs as much as a
    full one): the same numbers here, in a custom loop and in evaluate, on one device and on 2
    replicas (where the batch is the global batch)."""
    from keras_metrics_workers import one_d_regression, one_d_regression_mirrored

    want = one_d_regression(sg.OneDeviceStrategy("cpu"))
    preds, y = np.array(want["predictions"], dtype=np.float32), np.array(want["y"], dtype=np.float32)
    keras_values = {}
    for name, cls in (("mae", keras.metrics.MeanAbsoluteError), ("mse", keras.metrics.MeanSquaredError),
                      ("mape", keras.metrics.MeanAbsolutePercentageError)):
        m = cls()
        for i in range(0, 11, 4):
            m.update_state(y[i : i + 4], preds[i : i + 4])
        keras_values[name] = float(m.result())
    per_example = float(np.abs(preds - y).mean())
    assert abs(keras_values["mae"] - per_example) > 1e-3  # the data tells the two counts apart
    _close(want["loop_mae"], keras_values["mae"], tol=1e-5)
    for name in ("mae", "mse", "mape"):
        _close(want["evaluate"][name], keras_values[name], tol=1e-5)
    got = [r.value for r in run_workers(one_d_regression_mirrored, 2, timeout=200)]
    for g in got:
        _close(g["loop_mae"], want["loop_mae"], tol=1e-6)
        assert list(g["evaluate"]) == list(want["evaluate"])
        _close(list(g["evaluate"].values()), list(want["evaluate"].values()), tol=1e-6)
