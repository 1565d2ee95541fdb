"""Keras's everyday model API on stratagem's models (issue 50, item 4): summary, count_params,
get_weights / set_weights, get_layer, layers, the weights lists and ``trainable``.

The oracle is Keras 3 on its torch backend: the same Dense network's summary table (line by line,
the layer names aside), counts and sizes, frozen or not; a frozen BatchNorm trains as Keras's does.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import stratagem as sg  # noqa: E402
from stratagem.train.model_api import ModelAPI, apply_trainable  # noqa: E402

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:keras")
if keras.backend.backend() != "torch":  # pragma: no cover - another backend chosen by the caller
    pytest.skip("these tests compare with Keras on its torch backend", allow_module_level=True)

# sg.Model has ModelAPI among its bases; until it does, the tests give it to them here
Sequential = sg.Sequential if issubclass(sg.Sequential, ModelAPI) else type("Sequential", (ModelAPI, sg.Sequential), {})
Model = sg.Model if issubclass(sg.Model, ModelAPI) else type("Model", (ModelAPI, sg.Model), {})


def _keras_dense(*, freeze_first: bool = False):
    keras.utils.set_random_seed(0)
    km = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, name="0"), keras.layers.Dense(10, name="1")],
                          name="sequential")
    model = Sequential(nn.Linear(64, 64), nn.Linear(64, 10))
    with torch.no_grad():
        for lin, layer in zip(model, km.layers):
            kernel, bias = layer.get_weights()
            lin.weight.copy_(torch.from_numpy(kernel.T))
            lin.bias.copy_(torch.from_numpy(bias))
    if freeze_first:
        km.layers[0].trainable = False
        model[0].trainable = False
    return km, model


def _text(model, **kw) -> str:
    out: list[str] = []
    model.summary(print_fn=out.append, **kw)
    assert len(out) == 1  # Keras 3 gives print_fn the whole summary at once
    return out[0]


@pytest.mark.parametrize(
    "kw", [{}, {"line_length": 60, "show_trainable": True}, {"line_length": 40}, {"line_length": 76, "positions": [0.5, 0.75, 1.0]}]
)
@pytest.mark.parametrize("freeze_first", [False, True])
def test_summary_is_keras_table_line_by_line(kw, freeze_first):
    km, model = _keras_dense(freeze_first=freeze_first)
    want = _text(km, **kw).splitlines()
    got = _text(model, input_shape=(None, 64), **kw).splitlines()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = w.replace("(Dense) ", "(Linear)")  # the Keras layers are named as torch's: "0", "1"
        assert g == w, f"\n{g}\n{w}"
    assert model.count_params() == km.count_params() == 4810
    assert " Total params: 4,810 (18.79 KB)" in got
    if freeze_first:
        assert " Trainable params: 650 (2.54 KB)" in got
        assert " Non-trainable params: 4,160 (16.25 KB)" in got


def test_summary_of_an_unbuilt_model_and_of_nested_layers():
    model = Sequential(nn.Linear(4, 3), nn.ReLU(), nn.LazyLinear(2))
    text = _text(model, show_trainable=True, line_length=80)
    rows = [ln for ln in text.splitlines() if ln.startswith("│")]
    assert "│ 0 (Linear)" in rows[0] and "│ ?" in rows[0] and "15 │" in rows[0] and "│   Y" in rows[0]
    assert "│ 1 (ReLU)" in rows[1] and rows[1].rstrip("│ ").endswith("-")  # no weights: "-"
    assert "0 (unbuilt)" in rows[2]  # Keras's unbuilt layer
    assert text.splitlines()[0] == 'Model: "sequential"'

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)

        def forward(self, x):
            return self.norm(self.inner(x))

    class Net(Model):
        def __init__(self):
            super().__init__()
            self.block = Block()
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.block(x)), {"h": x}

    net = Net()
    text = _text(net, expand_nested=True, input_shape=(None, 4), line_length=88)
    lines = text.splitlines()
    assert lines[0] == 'Model: "net"'
    assert any("│ block (Block)" in ln and "(None, 4)" in ln and ln.endswith(" 28 │") for ln in lines)
    assert any("│    └ inner (Linear)" in ln and ln.endswith(" 20 │") for ln in lines)
    assert any("│    └ norm (LayerNorm)" in ln and ln.endswith(" 8 │") for ln in lines)
    assert any("│ head (Linear)" in ln and "(None, 2)" in ln for ln in lines)
    assert " Total params: 38 (152.00 B)" in lines
    # build() records the input shape for later summaries (Keras's model.build(input_shape))
    net.build((None, 4))
    assert "(None, 4)" in _text(net)
    # a fixed batch dimension is kept as given
    assert "(3, 4)" in _text(net, input_shape=(3, 4))


def test_batch_norm_counts_and_trainable_split_against_keras():
    """Keras's BatchNormalization counts gamma, beta, moving mean and variance (non-trainable); a
    torch BatchNorm also has its num_batches_tracked counter, one more weight (documented)."""

    class KerasNet(keras.Model):
        def __init__(self):
            super().__init__()
            self.d1 = keras.layers.Dense(8)
            self.bn = keras.layers.BatchNormalization()
            self.d2 = keras.layers.Dense(2)

        def call(self, x):
            return self.d2(self.bn(self.d1(x)))

    km = KerasNet()
    km(keras.ops.zeros((3, 4)))
    model = Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    assert model.count_params() == km.count_params() + 1 == 91
    assert sum(int(np.prod(v.shape)) for v in model.trainable_weights) == sum(int(np.prod(w.shape)) for w in km.trainable_weights) == 74
    assert sum(int(np.prod(v.shape)) for v in model.non_trainable_weights) == 16 + 1
    # Keras's order and its torch backend's form: v.value is the tensor itself, v.path its name
    assert [v.path for v in model.weights] == list(model.state_dict())
    assert [v.path for v in model.trainable_weights] == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    assert model.trainable_weights[0].value is model[0].weight
    assert [tuple(w.shape) for w in model.get_weights()] == [(8, 4), (8,), (8,), (8,), (8,), (8,), (), (2, 8), (2,)]
    assert " Non-trainable params: 17 (72.00 B)" in _text(model)  # 16 float32 + one int64


def test_get_weights_set_weights_round_trip_and_errors():
    model = Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    keys = list(model.state_dict())
    weights = model.get_weights()
    assert len(weights) == len(keys) and all(isinstance(w, np.ndarray) for w in weights)
    for w, (k, v) in zip(weights, model.state_dict().items()):
        np.testing.assert_array_equal(w, v.numpy(), err_msg=k)
    new = [w + 1 if w.dtype.kind == "f" else w + 2 for w in weights]
    model.set_weights(new)
    for w, v in zip(new, model.get_weights()):
        np.testing.assert_array_equal(w, v)
    weights[0] += 100  # get_weights gives copies
    assert not np.array_equal(model.get_weights()[0], weights[0])
    with pytest.raises(ValueError, match=r"the model has 9 weights \(0.weight, 0.bias, .*but 2 arrays were given"):
        model.set_weights(new[:2])
    bad = list(new)
    bad[0] = np.zeros((3, 4), dtype=np.float32)  # Keras's kernel layout (in, out), not torch's (out, in)
    with pytest.raises(ValueError, match=r"weight '0.weight' has shape \(4, 3\), but the array given for it has shape \(3, 4\)"):
        model.set_weights(bad)
    # Keras's Dense weights go in once the kernels are transposed: the same predictions
    km, same = _keras_dense()
    same.set_weights([w.T if w.ndim == 2 else w for w in km.get_weights()])
    x = np.random.default_rng(0).normal(size=(5, 64)).astype("float32")
    np.testing.assert_allclose(same(torch.from_numpy(x)).detach().numpy(), np.asarray(km(x).detach().cpu()), rtol=1e-5, atol=1e-5)


def test_a_tied_weight_is_one_weight():
    class Tied(Model):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, x):
            return self.out(self.embed(x))

    model = Tied()
    assert model.count_params() == 40 and len(model.get_weights()) == 1
    assert "(None, 3, 10)" in _text(model, input_shape=(None, 3))  # an embedding's input: indices


def test_get_layer_and_layers():
    class Net(Model):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(2, 3), nn.Tanh())
            self.head = nn.Linear(3, 1)

        def forward(self, x):
            return self.head(self.encoder(x))

    net = Net()
    assert net.layers == [net.encoder, net.head]
    assert net.get_layer("head") is net.head and net.get_layer(index=0) is net.encoder
    assert net.get_layer(index=-1) is net.head and net.get_layer("encoder.0") is net.encoder[0]
    with pytest.raises(ValueError, match=r"No such layer: decoder. Existing layers are: \['encoder', 'head'\]"):
        net.get_layer("decoder")
    with pytest.raises(ValueError, match="only has 2 layers"):
        net.get_layer(index=2)
    with pytest.raises(ValueError, match="Provide only a layer name or a layer index"):
        net.get_layer("head", 1)
    with pytest.raises(ValueError, match="Provide either a layer name or layer index"):
        net.get_layer()
    seq = Sequential(nn.Linear(2, 2), nn.ReLU())
    assert seq.get_layer("1") is seq[1] and len(seq.layers) == 2


def test_a_module_own_layers_and_weights_attributes_win():
    """A transformer's ``self.layers = nn.ModuleList(...)`` stays its own under the mixin."""

    class Stack(Model):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
            self.weights = [1, 2]  # a plain attribute of the same name

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    s = Stack()
    assert isinstance(s.layers, nn.ModuleList) and s.weights == [1, 2]
    assert s.get_layer("layers.1") is s.layers[1]
    assert s.count_params() == 12 and len(s.trainable_weights) == 4


def test_trainable_false_freezes_and_thaws_as_keras():
    model = Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    assert model.trainable is True and len(model.trainable_weights) == 4
    model.trainable = False
    assert model.trainable_weights == [] and all(not p.requires_grad for p in model.parameters())
    assert len(model.non_trainable_weights) == 4
    model.trainable = True  # Keras: setting a model trainable sets every layer trainable
    assert len(model.trainable_weights) == 4 and all(p.requires_grad for p in model.parameters())
    model[0].trainable = False  # a plain nn.Linear: an attribute, seen at once by the lists ...
    assert [tuple(t.shape) for t in model.trainable_weights] == [(1, 4), (1,)]
    assert model[0].weight.requires_grad  # ... and applied to requires_grad by apply_trainable (fit)
    apply_trainable(model)
    assert not model[0].weight.requires_grad and model[2].weight.requires_grad
    model[0].trainable = True
    apply_trainable(model)
    assert model[0].weight.requires_grad
    # a parent's False overrides a child's True, as a non-trainable Keras layer has no trainable weights
    model.trainable = False
    model[0].trainable = True
    assert model.trainable_weights == []
    model.trainable = True
    # what a user froze by hand stays frozen: apply_trainable thaws only what trainable froze
    model[2].bias.requires_grad_(False)
    apply_trainable(model)
    assert not model[2].bias.requires_grad
    with pytest.raises(TypeError, match="trainable must be True or False"):
        model.trainable = "no"


def test_frozen_parameters_do_not_move_even_with_an_optimizer_built_before():
    """torch's optimizers skip a parameter whose grad is None: one frozen after Adam has stepped
    (momentum in its state) stays where it is; the others keep training."""
    torch.manual_seed(0)
    model = Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    model.compile(optimizer=sg.optimizers.Adam(learning_rate=0.05), loss="mse")
    x, y = torch.randn(64, 3), torch.randn(64, 1)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.optimizer.state  # Adam has moments for every parameter
    model[0].trainable = False
    apply_trainable(model)  # fit calls it; called here too so the test holds either way
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    after = model.state_dict()
    for k in ("0.weight", "0.bias"):
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    for k in ("2.weight", "2.bias"):
        assert not torch.equal(after[k], before[k]), k
    summary = _text(model, show_trainable=True, line_length=80)
    assert " Trainable params: 5 (20.00 B)" in summary and " Non-trainable params: 16 (64.00 B)" in summary
    assert " Optimizer params:" in summary  # Keras prints the built optimizer's state too


def test_fit_applies_a_plain_layers_trainable_attribute():
    """``layer.trainable = False`` on a torch layer (an attribute torch does not know) is honoured
    by fit without any other call."""
    torch.manual_seed(0)
    model = Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    model.compile(optimizer="sgd", loss="mse")
    model.layers[2].trainable = False
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.fit(torch.randn(32, 3), torch.randn(32, 1), batch_size=8, epochs=1, verbose=0)
    after = model.state_dict()
    assert torch.equal(after["2.weight"], before["2.weight"]) and torch.equal(after["2.bias"], before["2.bias"])
    assert not torch.equal(after["0.weight"], before["0.weight"])


def test_a_frozen_batch_norm_trains_in_inference_mode_as_keras():
    """Keras 3: BatchNormalization(trainable=False) runs in inference mode in fit (moving statistics
    used and kept). The same network, frozen BatchNorm, one epoch of SGD: Keras's weights."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32") + 0.5
    y = rng.normal(size=(64, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    km = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6), keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    km.layers[1].set_weights([rng.uniform(0.5, 1.5, 6).astype("float32"), rng.normal(size=6).astype("float32"),
                              rng.normal(size=6).astype("float32"), rng.uniform(0.5, 2, 6).astype("float32")])
    model = Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, eps=1e-3, momentum=0.01), nn.Linear(6, 1))
    kw = km.get_weights()
    model.set_weights([kw[0].T, kw[1], *kw[2:6], np.array(0), kw[6].T, kw[7]])
    km.layers[1].trainable = False
    model.layers[1].trainable = False
    km.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.compile(optimizer=sg.optimizers.SGD(learning_rate=0.01), loss="mse")
    kh = km.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    sh = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(sh, kh, rtol=2e-5, atol=2e-6)
    kw2, sw = km.get_weights(), model.get_weights()
    np.testing.assert_allclose(sw[0], kw2[0].T, rtol=2e-5, atol=2e-6)
    for got, want in zip(sw[2:6], kw2[2:6]):  # gamma, beta, moving mean and variance: unchanged
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(sw[7], kw2[6].T, rtol=2e-5, atol=2e-6)
    assert model.layers[1].training is False and model.layers[0].training is True


def test_record_input_gives_summary_its_shapes_as_a_first_fit_does():
    """``record_input(model, x)`` (for fit / predict on arrays) remembers the input shape as
    Keras's first fit builds a subclassed model: summary then shows output shapes."""
    from stratagem.train.model_api import record_input

    model = Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    assert "│ ?" in _text(model)
    record_input(model, np.zeros((5, 3), dtype=np.int64))
    text = _text(model)
    assert "(None, 3, 4)" in text and "(None, 12)" in text and "(None, 2)" in text
    record_input(model, np.zeros((5, 7), dtype=np.int64))  # the first shape stays, as a build does
    assert "(None, 3, 4)" in _text(model)
    record_input(Sequential(nn.Linear(2, 2)), {"a": np.zeros((1, 2))})  # a dict: not recorded


def test_a_wrong_input_shape_says_so():
    model = Sequential(nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"the model failed on zeros of input_shape \(None, 5\) \(RuntimeError: .*batch dimension first"):
        model.summary(input_shape=(None, 5))


def test_nested_outputs_show_every_shape_the_batch_as_none_where_it_is():
    class Recurrent(Model):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 3, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0]

    text = _text(Recurrent(), input_shape=(None, 5, 4), line_length=100, positions=[0.3, 0.85, 1.0])
    # the output, then (h, c): the batch is their second dimension
    assert "│ ((None, 5, 3), ((1, None, 3), (1, None, 3)))" in text
