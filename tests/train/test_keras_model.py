"""Keras's habits on the model (issue 30): compile / fit(x, y, ...) / evaluate / predict / save.

The oracle is Keras itself: Keras 3 on its torch backend runs the same programs here, from the
same initial weights, and stratagem must give its numbers (history, evaluate, predict, optimizer
updates, learning-rate schedules). The guide's program then runs under MirroredStrategy(2) with
single-device parity.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from keras_model_workers import digits, guide_program, make_model, mirrored_guide  # noqa: E402
from torch import nn  # noqa: E402

import stratagem as sg  # noqa: E402
from stratagem.testing import run_workers  # noqa: E402

keras = pytest.importorskip("keras")
# Keras's own code (not stratagem's) trips numpy 2's __array__(copy=) deprecation on its torch backend
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:keras")
if keras.backend.backend() != "torch":  # pragma: no cover - another backend chosen by the caller
    pytest.skip("these tests compare with Keras on its torch backend", allow_module_level=True)


def _keras_guide_model() -> tuple[object, sg.Sequential]:
    """The guide's functional Keras model and the same model in torch with its initial weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(64,), name="digits")
    h = keras.layers.Dense(64, activation="relu", name="dense_1")(inputs)
    h = keras.layers.Dense(64, activation="relu", name="dense_2")(h)
    outputs = keras.layers.Dense(10, activation="softmax", name="predictions")(h)
    km = keras.Model(inputs=inputs, outputs=outputs)
    model = make_model()
    with torch.no_grad():
        for lin, layer in zip([model[0], model[2], model[4]], km.layers[1:]):
            kernel, bias = layer.get_weights()
            lin.weight.copy_(torch.from_numpy(kernel.T))
            lin.bias.copy_(torch.from_numpy(bias))
    return km, model


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("validation", ["data", "split"])
def test_the_guide_program_gives_keras_numbers(validation):
    """The "training & evaluation with built-in methods" guide, call by call, against Keras."""
    x_train, y_train, x_test, y_test = digits()
    km, model = _keras_guide_model()
    runs = []
    for m, opt, loss, metrics in [
        (km, keras.optimizers.RMSprop(), keras.losses.SparseCategoricalCrossentropy(),
         [keras.metrics.SparseCategoricalAccuracy()]),
        (model, sg.optimizers.RMSprop(), sg.losses.SparseCategoricalCrossentropy(),
         [sg.metrics.SparseCategoricalAccuracy()]),
    ]:
        m.compile(optimizer=opt, loss=loss, metrics=metrics)
        if validation == "data":
            x_val, y_val = x_train[-300:], y_train[-300:]
            history = m.fit(x_train[:-300], y_train[:-300], batch_size=64, epochs=2,
                            validation_data=(x_val, y_val), shuffle=False, verbose=0)
        else:
            history = m.fit(x_train, y_train, batch_size=64, epochs=2, validation_split=0.2, shuffle=False, verbose=0)
        results = m.evaluate(x_test, y_test, batch_size=128, verbose=0)
        predictions = m.predict(x_test[:3], verbose=0)
        runs.append((history.history, results, np.asarray(predictions.detach() if hasattr(predictions, "detach") else predictions)))
    (kh, kr, kp), (sh, sr, sp) = runs
    assert list(sh) == list(kh)  # the same log names, in the same order
    for key in kh:
        _close(sh[key], kh[key])
    assert isinstance(sr, list) and len(sr) == 2  # loss, acc = model.evaluate(...)
    _close(sr, kr)
    assert sp.shape == kp.shape == (3, 10)
    _close(sp, kp)
    assert model.metrics_names == ["loss", "sparse_categorical_accuracy"]
    assert model.evaluate(x_test, y_test, batch_size=128, verbose=0, return_dict=True).keys() == {
        "loss", "sparse_categorical_accuracy"}


def _trajectory(make_opt, steps: int = 6, keras_side: bool = False) -> list[np.ndarray]:
    g = np.random.default_rng(3)
    grads = [g.standard_normal((4, 3)).astype("float32") * (0.1 + i) for i in range(steps)]
    w0 = g.standard_normal((4, 3)).astype("float32")
    out = []
    if keras_side:
        v = keras.Variable(w0)
        opt = make_opt()
        for grad in grads:
            opt.apply_gradients([(keras.ops.convert_to_tensor(grad), v)])
            out.append(np.array(keras.ops.convert_to_numpy(v)))
        return out
    p = nn.Parameter(torch.from_numpy(w0.copy()))
    opt = make_opt().build([p])
    for grad in grads:
        p.grad = torch.from_numpy(grad)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


OPTIMIZERS = {
    "sgd": lambda ns: ns.SGD(learning_rate=0.1),
    "sgd_momentum": lambda ns: ns.SGD(learning_rate=0.1, momentum=0.9),
    "sgd_nesterov": lambda ns: ns.SGD(learning_rate=0.1, momentum=0.9, nesterov=True),
    "rmsprop": lambda ns: ns.RMSprop(),
    "rmsprop_centered_momentum": lambda ns: ns.RMSprop(learning_rate=0.01, momentum=0.5, centered=True),
    "adam": lambda ns: ns.Adam(learning_rate=0.01),
    "adamw": lambda ns: ns.AdamW(learning_rate=0.01),
    "adagrad": lambda ns: ns.Adagrad(learning_rate=0.1),
    "exponential": lambda ns: ns.SGD(learning_rate=ns.schedules.ExponentialDecay(0.1, 2, 0.5, staircase=True)),
    "piecewise": lambda ns: ns.SGD(learning_rate=ns.schedules.PiecewiseConstantDecay([1, 3], [0.1, 0.05, 0.01])),
    "inverse_time": lambda ns: ns.SGD(learning_rate=ns.schedules.InverseTimeDecay(0.1, 2, 0.5)),
    "polynomial": lambda ns: ns.SGD(learning_rate=ns.schedules.PolynomialDecay(0.1, 4, 0.01, power=2.0)),
    "cosine_warmup": lambda ns: ns.Adam(learning_rate=ns.schedules.CosineDecay(
        0.0, 4, alpha=0.1, warmup_target=0.05, warmup_steps=2)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_and_schedules_update_as_keras_does(name):
    ours = _trajectory(lambda: OPTIMIZERS[name](sg.optimizers))
    theirs = _trajectory(lambda: OPTIMIZERS[name](keras.optimizers), keras_side=True)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{name}: after update {step + 1}")


def test_optimizer_names_take_keras_defaults():
    p = [nn.Parameter(torch.zeros(2))]
    assert sg.optimizers.get("rmsprop", p).param_groups[0]["rho"] == 0.9
    assert sg.optimizers.get("adam", p).param_groups[0]["eps"] == 1e-7
    assert sg.optimizers.get("sgd", p).param_groups[0]["lr"] == 0.01
    with pytest.raises(ValueError, match="'nadam' is a Keras optimizer stratagem does not offer"):
        sg.optimizers.get("nadam", p)
    with pytest.raises(TypeError, match="unexpected argument"):
        sg.optimizers.Adam(beta1=0.9)


def test_schedule_iterations_resume_from_the_state_dict():
    def make(params):
        return sg.optimizers.SGD(learning_rate=sg.optimizers.schedules.ExponentialDecay(1.0, 1, 0.5)).build(params)

    p = nn.Parameter(torch.ones(1))
    opt = make([p])
    for _ in range(3):
        p.grad = torch.ones(1)
        opt.step()
    q = nn.Parameter(p.detach().clone())
    resumed = make([q])
    resumed.load_state_dict(opt.state_dict())
    assert resumed.iterations == 3 and resumed.learning_rate == pytest.approx(0.125)
    p.grad, q.grad = torch.ones(1), torch.ones(1)
    opt.step()
    resumed.step()
    assert torch.equal(p, q)


def test_multi_output_losses_are_weighted_and_summed():
    class TwoHeads(sg.Model):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(5, 8)
            self.a = nn.Linear(8, 3)
            self.b = nn.Linear(8, 1)

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return {"cls": self.a(h), "reg": self.b(h)}

    torch.manual_seed(1)
    x = torch.randn(16, 5)
    y = {"cls": torch.randint(0, 3, (16,)), "reg": torch.randn(16, 1)}
    model = TwoHeads()
    model.compile(optimizer="sgd", loss={"cls": sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                                         "reg": "mse"}, loss_weights={"cls": 1.0, "reg": 0.5})
    got = model.evaluate(x, y, batch_size=16, verbose=0)
    with torch.no_grad():
        out = model(x)
    cls, reg = nn.functional.cross_entropy(out["cls"], y["cls"]), nn.functional.mse_loss(out["reg"], y["reg"])
    # Keras's evaluate: the weighted total, then each output's loss (before its loss_weight)
    assert got == pytest.approx([(cls + 0.5 * reg).item(), cls.item(), reg.item()], rel=1e-5)


def test_keras_model_gives_any_module_the_methods_and_keeps_its_keys(tmp_path):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=-1))
    keys = list(plain.state_dict())
    model = sg.keras_model(plain)
    assert model is plain and isinstance(model, nn.Sequential) and isinstance(model, sg.Model)
    assert list(model.state_dict()) == keys
    x, y = np.random.default_rng(0).standard_normal((20, 4)).astype("float32"), np.arange(20) % 3
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.save_weights(tmp_path / "w")
    other = sg.keras_model(nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=-1)))
    other.load_weights(tmp_path / "w")
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


class Net(sg.Model):
    """A model with Keras's get_config: load_model rebuilds it without being handed one."""

    def __init__(self, width=8):
        super().__init__()
        self.width = width
        self.fc = nn.Linear(4, width)

    def forward(self, x):
        return self.fc(x)

    def get_config(self):
        return {"width": self.width}


def test_save_and_load_model(tmp_path):
    torch.manual_seed(0)
    model = Net(6)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.save(tmp_path / "m")
    back = sg.load_model(tmp_path / "m")  # rebuilt from get_config, compiled again by name
    assert isinstance(back, Net) and back.width == 6
    for a, b in zip(model.parameters(), back.parameters()):
        assert torch.equal(a, b)
    assert back.loss == "mse" and back.optimizer is not None

    plain = sg.Sequential(nn.Linear(4, 2))
    plain.compile(optimizer="sgd", loss="mse")
    plain.save(tmp_path / "p")
    with pytest.raises(ValueError, match="not its architecture"):
        sg.load_model(tmp_path / "p")
    sg.load_model(tmp_path / "p", model=sg.Sequential(nn.Linear(4, 2)))


def test_clear_errors_before_training():
    x, y = np.zeros((10, 4), "float32"), np.zeros(10)
    model = sg.Sequential(nn.Linear(4, 2), nn.Softmax(dim=-1))
    with pytest.raises(RuntimeError, match=r"You must call `compile\(\)`"):
        model.fit(x, y)
    model.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="validation_data's x has samples of shape"):
        model.fit(x, y, validation_data=(np.zeros((4, 5), "float32"), np.zeros(4)), verbose=0)
    with pytest.raises(ValueError, match="same number of rows"):
        model.fit(x, y[:9], verbose=0)
    with pytest.raises(ValueError, match="not sufficient to split"):
        model.fit(x[:1], y[:1], validation_split=0.5, verbose=0)
    ds = sg.data.Dataset.from_tensor_slices((torch.zeros(10, 4), torch.zeros(10, dtype=torch.long))).batch(5)
    with pytest.raises(ValueError, match="`y` argument is not supported when using a dataset"):
        model.fit(ds, y, verbose=0)
    with pytest.raises(ValueError, match="validation_split is only supported for tensors or numpy arrays"):
        model.fit(ds, validation_split=0.1, verbose=0)
    lazy = sg.Sequential(nn.LazyLinear(2))
    with pytest.raises(ValueError, match="run one batch through it first"):
        lazy.compile("sgd", "mse")


def test_the_guide_under_mirrored_strategy_equals_one_device(tmp_path):
    """compile / fit(x, y, batch_size, validation_split, shuffle) / evaluate / predict / save under
    MirroredStrategy(2) give what one device gives on the global batch."""
    want = guide_program(sg.OneDeviceStrategy("cpu"))
    got = [r.value for r in run_workers(mirrored_guide, 2, args=(str(tmp_path),), timeout=240)]
    for g in got:
        assert g["iterations"] == want["iterations"] == 3 * 19  # 1200 rows x 0.8 / 64, rounded up
        assert list(g["history"]) == list(want["history"])
        for key in want["history"]:
            _close(g["history"][key], want["history"][key], tol=1e-4)
        _close(g["evaluate"], want["evaluate"], tol=1e-4)
        _close(g["predictions"], want["predictions"], tol=1e-4)
        for k in want["params"]:
            _close(g["params"][k], want["params"][k], tol=1e-4)
        _close(g["reloaded_evaluate"], g["evaluate"], tol=1e-6)


def over_prediction(y_true, y_pred):
    """A Keras-style custom loss (the guides name its arguments y_true, y_pred); asymmetric."""
    return ((y_pred - y_true).clamp(min=0) ** 2).mean(dim=-1)


def test_a_custom_loss_function_written_as_keras_writes_it_gets_labels_first():
    torch.manual_seed(0)
    x, y = torch.randn(32, 3), torch.randn(32, 1)
    model = sg.Sequential(nn.Linear(3, 1))
    model.compile("sgd", loss=over_prediction)
    with torch.no_grad():
        out = model(x)
    got = model.evaluate(x, y, batch_size=32, verbose=0)
    assert got == pytest.approx(over_prediction(y, out).mean().item(), rel=1e-6)
    assert got != pytest.approx(over_prediction(out, y).mean().item(), rel=1e-3)  # the order matters here
    # a torch-style function (any other parameter names) keeps torch's (outputs, y)
    model.compile("sgd", loss=lambda outputs, target: ((outputs - target).clamp(min=0) ** 2).mean())
    assert model.evaluate(x, y, batch_size=32, verbose=0) == pytest.approx(over_prediction(y, out).mean().item(), rel=1e-6)
