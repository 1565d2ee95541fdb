"""Keras's train_step / test_step / predict_step overrides (issue 50): called by fit, evaluate and
predict as Keras 3 calls them, with Keras's numbers, and under MirroredStrategy(2) equal to one
device on the global batch. Also (N, 1) sample weights, the guide's own, weigh examples as Keras's."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from keras_overrides_workers import (  # noqa: E402
    GAN,
    CustomModel,
    Frozen,
    LowerLevel,
    custom_program,
    data,
    guide_test_step,
    guide_train_step,
    mirrored_custom,
)
from torch import nn  # noqa: E402

import stratagem as sg  # noqa: E402
from stratagem.testing import run_workers  # noqa: E402

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:keras")
if keras.backend.backend() != "torch":  # pragma: no cover
    pytest.skip("these tests compare with Keras on its torch backend", allow_module_level=True)


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=tol, atol=tol)


def _keras_dense(units_in: int = 32):
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(units_in,))
    return inputs, keras.layers.Dense(1)(inputs)


def _copy_dense(km, linear: nn.Linear) -> None:
    dense = [layer for layer in km.layers if layer.get_weights()][0]
    kernel, bias = dense.get_weights()
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(kernel.T))
        linear.bias.copy_(torch.from_numpy(bias))


class _KerasCustom(keras.Model):
    """The same guide code on Keras 3's own Model."""

    calls = {"train_step": 0, "test_step": 0}
    train_step = guide_train_step
    test_step = guide_test_step


def test_the_guides_train_step_and_test_step_are_called_with_keras_numbers():
    """fit(x, y, sample_weight=(N, 1)) calls train_step 96 times (1000 rows / 32, 3 epochs) and
    evaluate calls test_step 32 times, as Keras does, and both give Keras's numbers."""
    x, y, sw = data(1000)
    km = _KerasCustom(*_keras_dense())
    km.compile(optimizer="adam", loss="mse", metrics=["mae"])
    sm = CustomModel(nn.Linear(32, 1))
    _copy_dense(km, sm[0])
    sm.compile(optimizer="adam", loss="mse", metrics=["mae"])
    _KerasCustom.calls.update(train_step=0, test_step=0)
    CustomModel.calls.update(train_step=0, test_step=0, predict_step=0)
    kh = km.fit(x, y, sample_weight=sw, epochs=3, shuffle=False, verbose=0).history
    sh = sm.fit(x, y, sample_weight=sw, epochs=3, shuffle=False, verbose=0).history
    assert set(sh) == set(kh) == {"loss", "mae"}
    for key in kh:
        _close(sh[key], kh[key])
    _close(sm.evaluate(x, y, verbose=0), km.evaluate(x, y, verbose=0))
    assert CustomModel.calls["train_step"] == _KerasCustom.calls["train_step"] == 96
    assert CustomModel.calls["test_step"] == _KerasCustom.calls["test_step"] == 32
    assert sm.metrics_names == ["loss", "mae"]
    # predict_step is called too (this one doubles the outputs)
    out = sm.predict(x[:7], verbose=0)
    _close(out, 2.0 * sm(torch.from_numpy(x[:7])).detach())
    assert CustomModel.calls["predict_step"] == 1


def test_a_train_step_that_trains_nothing_leaves_the_weights():
    x, y, _ = data(200)
    model = Frozen(nn.Linear(32, 1))
    model.compile(optimizer="sgd", loss="mse")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    history = model.fit(x, y, epochs=2, verbose=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert len(history.history["loss"]) == 2


def test_going_lower_level_with_its_own_metrics_and_no_compiled_loss():
    """The guide's second model: compile(optimizer) only, its own loss and metrics property;
    its metrics are reset at each epoch (Keras's reset_metrics), so epoch 2 is epoch 2's alone."""
    x, y, _ = data(1000)
    km_cls = type("KerasLowerLevel", (keras.Model,), {})

    def k_init(self, *args, **kwargs):
        keras.Model.__init__(self, *args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    km_cls.__init__ = k_init
    km_cls.train_step = LowerLevel.train_step
    km_cls.metrics = LowerLevel.metrics
    km = km_cls(*_keras_dense())
    km.compile(optimizer="adam")
    sm = LowerLevel(nn.Linear(32, 1))
    _copy_dense(km, sm[0])
    sm.compile(optimizer="adam")
    kh = km.fit(x, y, epochs=3, shuffle=False, verbose=0).history
    sh = sm.fit(x, y, epochs=3, shuffle=False, verbose=0).history
    for key in ("loss", "mae"):
        _close(sh[key], kh[key])


def test_sample_weights_of_shape_n_by_1_weigh_examples_as_keras():
    """The built-in step: (N, 1) weights (the guide's) give Keras's numbers; SGD(0.01) no longer
    diverges; a shape that fits no example is an error naming both shapes."""
    x, y, sw = data(1000)
    inputs, outputs = _keras_dense()
    km = keras.Model(inputs, outputs)
    km.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    sm = sg.Sequential(nn.Linear(32, 1))
    _copy_dense(km, sm[0])
    sm.compile(optimizer=sg.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    kh = km.fit(x, y, sample_weight=sw, epochs=3, shuffle=False, verbose=0).history
    sh = sm.fit(x, y, sample_weight=sw, epochs=3, shuffle=False, verbose=0).history
    for key in kh:
        _close(sh[key], kh[key])
    with pytest.raises(ValueError, match=r"sample_weight has shape \(32, 2\).*\(32,\)"):
        sm.fit(x, y, sample_weight=np.ones((1000, 2), "float32"), epochs=1, verbose=0)
    # compute_average_loss (the custom loop's) takes (N, 1) weights alike
    losses = torch.arange(4.0)
    w = torch.tensor([[1.0], [0.0], [2.0], [1.0]])
    assert float(sg.compute_average_loss(losses, sample_weight=w)) == pytest.approx((0 + 0 + 4 + 3) / 4)


def test_a_gan_with_two_optimizers_and_no_forward_trains():
    """The guide's GAN: compile(d_optimizer, g_optimizer, loss_fn) with no forward; each step
    updates both networks (each recipe built over its own weights at its first apply)."""
    torch.manual_seed(0)
    latent_dim = 8
    discriminator = sg.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())
    generator = sg.Sequential(nn.Linear(latent_dim, 32), nn.LeakyReLU(0.2), nn.Linear(32, 16), nn.Sigmoid())
    gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
    d_opt, g_opt = sg.optimizers.Adam(learning_rate=0.0003), sg.optimizers.Adam(learning_rate=0.0003)
    gan.compile(d_optimizer=d_opt, g_optimizer=g_opt, loss_fn=sg.losses.BinaryCrossentropy())
    d0 = [p.detach().clone() for p in discriminator.parameters()]
    g0 = [p.detach().clone() for p in generator.parameters()]
    images = torch.rand(256, 16)
    dataset = sg.data.Dataset.from_tensor_slices(images).shuffle(buffer_size=256, seed=0).batch(64)
    history = gan.fit(dataset, epochs=2, verbose=0)
    assert set(history.history) == {"d_loss", "g_loss"}
    assert all(np.isfinite(v) for v in history.history["d_loss"] + history.history["g_loss"])
    assert d_opt.iterations == g_opt.iterations == 8
    assert all(not torch.equal(a, b) for a, b in zip(d0, discriminator.parameters()))
    assert all(not torch.equal(a, b) for a, b in zip(g0, generator.parameters()))


def test_the_override_under_mirrored_equals_one_device():
    """Under MirroredStrategy(2) each replica runs train_step on its half; the update equals one
    device's on the global batch (the gradients weighed by each replica's share), the logs too.
    1000 rows in batches of 48: the last batch (40) splits 20 / 20, the rest 24 / 24."""
    want = custom_program(sg.OneDeviceStrategy("cpu"))
    got = [r.value for r in run_workers(mirrored_custom, 2, timeout=240)]
    for g in got:
        assert set(g["history"]) == set(want["history"])
        for key in want["history"]:
            _close(g["history"][key], want["history"][key], tol=1e-5)
        for k in want["params"]:
            _close(g["params"][k], want["params"][k], tol=1e-5)
        _close(g["evaluate"], want["evaluate"], tol=1e-5)
        _close(g["predictions"], want["predictions"], tol=1e-5)
        assert g["calls"]["train_step"] == want["calls"]["train_step"] == 3 * 21
    assert got[0]["params"].keys() == got[1]["params"].keys()
    for k in got[0]["params"]:
        assert torch.equal(got[0]["params"][k], got[1]["params"][k])


def _assert_continues_alike(out):
    assert out["loaded"] == out["saved"]
    for k, v in out["saved_params"].items():
        assert torch.equal(out["loaded_params"][k], v), k
    assert out["iterations"][0] == out["iterations"][1]


def test_save_then_load_model_continues_bit_for_bit(tmp_path):
    """model.save("m.keras") is one zip (config, safetensors weights and the optimizer's state, no
    pickle); load_model rebuilds the registered class from get_config, and one more epoch on it
    equals one more on the saved model exactly (Adam's moments and iterations restored)."""
    import zipfile

    from keras_overrides_workers import save_load_program

    out = save_load_program(sg.OneDeviceStrategy("cpu"), str(tmp_path))
    _assert_continues_alike(out)
    names = zipfile.ZipFile(tmp_path / "m.keras").namelist()
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names)
    assert not any(n.endswith((".pt", ".pkl", ".bin")) for n in names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.keras"]  # no staging left behind


@pytest.mark.slow
def test_save_and_load_model_under_mirrored(tmp_path):
    got = [r.value for r in run_workers(_mirrored_save_load, 2, args=(str(tmp_path),), timeout=240)]
    for out in got:
        _assert_continues_alike(out)
    assert got[0]["loaded"] == got[1]["loaded"]


def _mirrored_save_load(directory):
    from keras_overrides_workers import mirrored_save_load

    return mirrored_save_load(directory)


def test_load_model_names_what_is_missing(tmp_path):
    class Local(sg.Model):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, x):
            return self.lin(x)

    m = Local()
    m.compile(optimizer="sgd", loss="mse")
    m.save(tmp_path / "local.keras")
    with pytest.raises(ValueError, match="load_model.*model="):
        sg.load_model(tmp_path / "local.keras")
    again = sg.load_model(tmp_path / "local.keras", model=Local())
    assert torch.equal(again.lin.weight, m.lin.weight)
    # TF's distribution tutorial's options: IO on this host, which is where it happens anyway
    m.save(tmp_path / "io.keras", options=sg.saved_model.SaveOptions(experimental_io_device="/job:localhost"))
    sg.load_model(tmp_path / "io.keras", model=Local(),
                  options=sg.saved_model.LoadOptions(experimental_io_device="/job:localhost"))
    with pytest.raises(ValueError, match="experimental_io_device='/job:worker/task:1'"):
        sg.saved_model.SaveOptions(experimental_io_device="/job:worker/task:1")
    with pytest.raises(TypeError, match="options"):
        m.save(tmp_path / "x.keras", options=object())


def test_the_on_batch_calls_give_keras_numbers():
    """train_on_batch / test_on_batch / predict_on_batch: each call resets the metrics first (Keras
    3), returns [loss, mae] or the dict; an overriding model's own train_step is what they run."""
    x, y, _ = data(96)
    inputs, outputs = _keras_dense()
    km = keras.Model(inputs, outputs)
    km.compile(optimizer="adam", loss="mse", metrics=["mae"])
    sm = sg.Sequential(nn.Linear(32, 1))
    _copy_dense(km, sm[0])
    sm.compile(optimizer="adam", loss="mse", metrics=["mae"])
    for i in range(3):
        part = slice(32 * i, 32 * (i + 1))
        _close(sm.train_on_batch(x[part], y[part]), km.train_on_batch(x[part], y[part]))
    _close(sm.test_on_batch(x[:32], y[:32]), km.test_on_batch(x[:32], y[:32]))
    k, s = km.test_on_batch(x[:32], y[:32], return_dict=True), sm.test_on_batch(x[:32], y[:32], return_dict=True)
    assert set(k) == set(s)
    _close([s[n] for n in sorted(s)], [k[n] for n in sorted(k)])
    _close(sm.predict_on_batch(x[:4]), np.asarray(km.predict_on_batch(x[:4])))
    custom = CustomModel(nn.Linear(32, 1))
    custom.compile(optimizer="adam", loss="mse", metrics=["mae"])
    CustomModel.calls.update(train_step=0, test_step=0, predict_step=0)
    loss, mae = custom.train_on_batch(x[:32], y[:32])
    assert CustomModel.calls["train_step"] == 1 and loss > 0 and mae > 0


def test_per_element_sample_weights_of_a_sequence_as_keras():
    """(N, T) weights against a sequence's (N, T) per-step losses weigh each step, as Keras's
    sum(w * loss) / (N * T); fit, evaluate and the history give Keras's numbers."""
    rng = np.random.default_rng(0)
    n, t, c = 64, 5, 4
    x = rng.random((n, t, 3)).astype("float32")
    y = rng.integers(0, c, (n, t))
    sw = rng.random((n, t)).astype("float32")
    keras.utils.set_random_seed(0)
    km = keras.Sequential([keras.Input((t, 3)), keras.layers.Dense(c, activation="softmax")])
    km.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    sm = sg.Sequential(nn.Linear(3, c), nn.Softmax(-1))
    _copy_dense(km, sm[0])
    sm.compile(optimizer=sg.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    kh = km.fit(x, y, sample_weight=sw, epochs=2, shuffle=False, verbose=0).history
    sh = sm.fit(x, y, sample_weight=sw, epochs=2, shuffle=False, verbose=0).history
    _close(sh["loss"], kh["loss"])
    _close(sm.evaluate(x, y, sample_weight=sw, verbose=0), km.evaluate(x, y, sample_weight=sw, verbose=0))
    with pytest.raises(ValueError, match=r"sample_weight has shape \(32, 3\) but the loss has shape \(32, 5\)"):
        sm.fit(x, y, sample_weight=np.ones((n, 3), "float32"), epochs=1, verbose=0)


def test_an_override_is_refused_where_the_strategy_cannot_run_it():
    from keras_overrides_workers import sharded_override_refused

    for r in run_workers(sharded_override_refused, 2, timeout=240):
        assert "overrides train_step" in r.value and "ShardedStrategy" in r.value, r.value
