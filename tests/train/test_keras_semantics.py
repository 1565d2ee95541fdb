"""Keras's semantics in fit/evaluate/predict, callbacks and losses (issue 30): each test is written
as a Keras user writes the program (Keras layers swapped for torch.nn) and asserts Keras's answer;
the 2-replica test checks the same programs under MirroredStrategy against one device."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from keras_semantics_workers import semantics_reference, semantics_worker
from torch import nn
from torch.nn import functional as F

import stratagem as sg
from stratagem.data import Dataset
from stratagem.testing import run_workers


def _xy(n: int = 32, features: int = 20, classes: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def _softmax_model(features: int = 20, classes: int = 2) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes), nn.Softmax(dim=-1))


def _batches(x: torch.Tensor, y: torch.Tensor, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


# --- 1. predict(x, batch_size) --------------------------------------------------------------------
def test_predict_on_an_array_batches_it_as_keras():
    x, _ = _xy()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    predictions = sg.predict(model, x)
    assert predictions.shape == (32, 2)  # not (64,): the tensor is x, not a list of batches
    torch.testing.assert_close(predictions, model(x).detach())
    assert sg.predict(model, x.numpy()).shape == (32, 2)  # numpy too

    seen: list[int] = []
    model.register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape[0]))
    x100 = torch.randn(100, 20)
    out = sg.predict(model, x100.numpy().astype(np.float64))  # Keras's default batch_size=32
    assert seen == [32, 32, 32, 4] and out.shape == (100, 2) and out.dtype == torch.float32
    seen.clear()
    torch.testing.assert_close(sg.predict(model, x100, batch_size=40), out)
    assert seen == [40, 40, 20]

    ds = Dataset.from_tensor_slices(x100).batch(10)
    with pytest.raises(ValueError, match="batch_size is for array inputs"):
        sg.predict(model, ds, batch_size=10)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        sg.predict(model, x, batch_size=0)


# --- 2. evaluate returns Keras's values -------------------------------------------------------------
def test_evaluate_returns_the_loss_or_a_list_or_a_dict_as_keras():
    x, y = _xy(40)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        out = model(x)
    want_loss = F.cross_entropy(out, y).item()
    want_acc = (out.argmax(1) == y).float().mean().item()
    data = _batches(x, y)

    loss, acc = sg.evaluate(model, nn.CrossEntropyLoss(), data, metrics=["accuracy"])
    assert loss == pytest.approx(want_loss, rel=1e-6) and acc == pytest.approx(want_acc)
    only = sg.evaluate(model, nn.CrossEntropyLoss(), data)  # no metrics: the loss alone, a float
    assert isinstance(only, float) and only == pytest.approx(want_loss, rel=1e-6)
    assert sg.evaluate(model, nn.CrossEntropyLoss(), data, metrics=["accuracy", "sparse_categorical_accuracy"],
                       return_dict=True).keys() == {"loss", "accuracy", "sparse_categorical_accuracy"}  # fmt: skip
    results = sg.evaluate(model, nn.CrossEntropyLoss(), data, metrics=["accuracy"], return_dict=True)
    assert results == pytest.approx({"loss": want_loss, "accuracy": want_acc}, rel=1e-6)

    # Keras's array form: evaluate(x, y, batch_size=...)
    seen: list[int] = []
    model.register_forward_hook(lambda m, inp, o: seen.append(inp[0].shape[0]))
    loss, acc = sg.evaluate(model, nn.CrossEntropyLoss(), (x, y), batch_size=16, metrics=["accuracy"])
    assert seen == [16, 16, 8] and loss == pytest.approx(want_loss, rel=1e-6) and acc == pytest.approx(want_acc)
    loss = sg.evaluate(model, nn.CrossEntropyLoss(), (x.numpy(), y.numpy()))
    assert loss == pytest.approx(want_loss, rel=1e-6)
    with pytest.raises(ValueError, match=r"needs labels: pass \(x, y\)"):
        sg.evaluate(model, nn.CrossEntropyLoss(), x)


# --- 3. stop_training from a callback -----------------------------------------------------------------
class LossHistory(sg.callbacks.Callback):  # the Keras guide's, as written there
    def on_train_begin(self, logs=None):
        self.per_batch_losses = []

    def on_batch_end(self, batch, logs=None):
        self.per_batch_losses.append(logs.get("loss"))


def test_model_stop_training_stops_after_the_epoch_or_the_batch_as_keras():
    x, y = _xy(32)
    data = _batches(x, y)  # 4 batches an epoch

    class StopAtEpochEnd(sg.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    model = _softmax_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = sg.fit(model, optimizer, "sparse_categorical_crossentropy", data, epochs=3,
                     callbacks=[StopAtEpochEnd()], verbose=0)
    assert len(history.history["loss"]) == 1 and model.stop_training is True  # Keras runs 1 of 3

    class StopAtBatch(sg.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_training = True

    for stopper in (StopAtBatch(), type("OnBatchEnd", (sg.callbacks.Callback,), {
            "on_batch_end": lambda self, batch, logs=None: setattr(self.model, "stop_training", batch == 1)})()):  # fmt: skip
        model = _softmax_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = LossHistory()
        history = sg.fit(model, optimizer, "sparse_categorical_crossentropy", data, epochs=3,
                         callbacks=[losses, stopper], verbose=0)
        assert len(losses.per_batch_losses) == 2 and len(history.history["loss"]) == 1  # 2 batches, then stop
        reference = _softmax_model()  # exactly two SGD steps on the first two batches
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for xb, yb in data[:2]:
            ref_opt.zero_grad()
            (-torch.log(reference(xb)[torch.arange(len(yb)), yb])).mean().backward()
            ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q)

    # a new fit starts with model.stop_training = False (Keras resets it)
    history = sg.fit(model, optimizer, "sparse_categorical_crossentropy", data, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2 and model.stop_training is False


# --- 4. on_batch_begin / on_batch_end -----------------------------------------------------------------
def test_the_keras_guides_loss_history_records_one_loss_per_batch():
    x, y = _xy(32)
    model = _softmax_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = LossHistory()
    begun: list[int] = []

    class Begin(sg.callbacks.Callback):
        def on_batch_begin(self, batch, logs=None):
            begun.append(batch)

    sg.fit(model, optimizer, "sparse_categorical_crossentropy", _batches(x, y), epochs=2,
           callbacks=[history, Begin()], verbose=0)
    assert len(history.per_batch_losses) == 8 and begun == [0, 1, 2, 3] * 2
    with torch.no_grad():
        first = _softmax_model()(x[:8])  # the first batch's loss, before its update
    assert history.per_batch_losses[0] == pytest.approx(float(-torch.log(first[torch.arange(8), y[:8]]).mean()), rel=1e-5)


# --- 5. Keras-named losses mean probabilities; contradictions are errors ------------------------------
def test_keras_named_crossentropies_take_probabilities_and_report_the_models_crossentropy():
    x, y = _xy(32, classes=3)
    model = _softmax_model(classes=3)
    with torch.no_grad():
        probs = model(x)
    want = float(-torch.log(probs[torch.arange(32), y]).mean())  # the model's cross-entropy
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = sg.fit(model, optimizer, "sparse_categorical_crossentropy", [(x, y)], epochs=1, verbose=0)
    assert history.history["loss"][0] == pytest.approx(want, rel=1e-5)  # not softmax(softmax(z))'s

    one_hot = F.one_hot(y, 3).float()
    cce = sg.evaluate(model, "categorical_crossentropy", (x, one_hot))
    with torch.no_grad():
        assert cce == pytest.approx(float(-(one_hot * torch.log(model(x))).sum(-1).mean()), rel=1e-5)

    torch.manual_seed(2)
    binary = nn.Sequential(nn.Linear(20, 1), nn.Sigmoid())
    yb = (x[:, 0] > 0).float()
    with torch.no_grad():
        p = binary(x).squeeze(-1)
    bce = sg.evaluate(binary, "binary_crossentropy", (x, yb))
    assert bce == pytest.approx(float(-(yb * torch.log(p) + (1 - yb) * torch.log(1 - p)).mean()), rel=1e-5)

    # the Keras classes with from_logits, standalone as Keras computes them
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.1, 0.2, 3.0]])
    labels = torch.tensor([0, 2])
    scce = sg.losses.SparseCategoricalCrossentropy(from_logits=True)
    assert float(scce(labels, logits)) == pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-6)
    probs2 = torch.softmax(logits, -1)
    assert float(sg.losses.SparseCategoricalCrossentropy()(labels, probs2)) == pytest.approx(
        float(F.cross_entropy(logits, labels)), rel=1e-5)
    per_example = sg.losses.SparseCategoricalCrossentropy(reduction=sg.losses.Reduction.NONE)(labels, probs2)
    assert per_example.shape == (2,)


def test_contradictions_between_the_loss_and_the_outputs_are_errors_on_the_first_batch():
    x, y = _xy(16, classes=3)
    torch.manual_seed(0)
    logits_model = nn.Sequential(nn.Linear(20, 3))
    opt = torch.optim.SGD(logits_model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"expects probabilities.*from_logits=True"):
        sg.fit(logits_model, opt, "sparse_categorical_crossentropy", [(x, y)], verbose=0)
    before = [p.detach().clone() for p in logits_model.parameters()]
    # what to write instead: from_logits=True, or a torch loss (logits, torch's meaning)
    sg.fit(logits_model, opt, sg.losses.SparseCategoricalCrossentropy(from_logits=True), [(x, y)], verbose=0)
    sg.fit(logits_model, opt, nn.CrossEntropyLoss(), [(x, y)], verbose=0)
    assert any(not torch.equal(a, b) for a, b in zip(before, logits_model.parameters()))

    softmax_model = _softmax_model(classes=3)
    opt = torch.optim.SGD(softmax_model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"from_logits=True\) expects logits.*Pass\s+from_logits=False"):
        sg.fit(softmax_model, opt, sg.losses.SparseCategoricalCrossentropy(from_logits=True), [(x, y)], verbose=0)

    torch.manual_seed(0)
    binary_logits = nn.Linear(20, 1)
    with pytest.raises(ValueError, match=r"binary_crossentropy.*expects probabilities in \[0, 1\].*from_logits=True"):
        sg.evaluate(binary_logits, "binary_crossentropy", (x, (y > 0).float()))


# --- 6. Keras-style Loss subclasses are called (y_true, y_pred) -----------------------------------------
class UnderPredictionCostsMore(sg.losses.Loss):  # a custom loss as the Keras guide writes one
    def call(self, y_true, y_pred):
        err = y_pred - y_true
        return torch.mean(torch.where(err < 0, 4.0 * err**2, err**2), dim=-1)


def test_a_keras_loss_subclass_gets_y_true_then_y_pred():
    y_true = torch.tensor([[1.0], [2.0]])
    y_pred = torch.tensor([[0.0], [3.0]])
    loss = UnderPredictionCostsMore()
    assert float(loss(y_true, y_pred)) == pytest.approx((4.0 + 1.0) / 2)  # sum_over_batch_size
    assert float(loss(y_true, y_pred, sample_weight=torch.tensor([1.0, 0.0]))) == pytest.approx(4.0 / 2)
    assert UnderPredictionCostsMore(reduction="none")(y_true, y_pred).tolist() == [4.0, 1.0]
    assert float(UnderPredictionCostsMore(reduction="sum")(y_true, y_pred)) == 5.0

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    with torch.no_grad():
        out = model(x)
    want = float(UnderPredictionCostsMore()(y, out))
    swapped = float(UnderPredictionCostsMore()(out, y))
    assert want != pytest.approx(swapped)
    assert sg.evaluate(model, UnderPredictionCostsMore(), (x, y)) == pytest.approx(want, rel=1e-6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = sg.fit(model, opt, UnderPredictionCostsMore(), [(x, y)], verbose=0)
    assert history.history["loss"][0] == pytest.approx(want, rel=1e-6)
    # Keras's functional losses are Keras-order too; a torch function keeps (outputs, y)
    labels = torch.randint(0, 2, (16,), generator=g)
    probs_model = nn.Sequential(nn.Linear(3, 2), nn.Softmax(dim=-1))
    with torch.no_grad():
        p = probs_model(x)
    assert sg.evaluate(probs_model, sg.losses.sparse_categorical_crossentropy, (x, labels)) == pytest.approx(
        float(-torch.log(p[torch.arange(16), labels]).mean()), rel=1e-5)
    with torch.no_grad():
        out = model(x)  # after fit's update
    assert sg.evaluate(model, F.l1_loss, (x, y)) == pytest.approx(float((out - y).abs().mean()), rel=1e-6)

    with pytest.raises(ValueError, match="sum_over_batch_size"):
        sg.fit(model, opt, UnderPredictionCostsMore(reduction="sum"), [(x, y)], verbose=0)


# --- 7. ModelCheckpoint's filepath template and latest_checkpoint ------------------------------------
def test_model_checkpoint_follows_the_tutorials_filepath_and_latest_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y = _xy(16, classes=3)
    model = _softmax_model(classes=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint_dir = "./training_checkpoints"  # the distributed-training tutorial, as written
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}")
    callbacks = [
        sg.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
        sg.callbacks.ModelCheckpoint("mymodel_{epoch}"),  # relative: the working directory, as Keras
        sg.callbacks.ModelCheckpoint(filepath="logs/w-{epoch:04d}-{loss:.2f}.keras", save_weights_only=True),
        sg.callbacks.ModelCheckpoint(filepath="best.keras", monitor="loss", save_best_only=True),
    ]
    history = sg.fit(model, optimizer, "sparse_categorical_crossentropy", [(x, y)], epochs=12, callbacks=callbacks,
                     verbose=0)
    assert sorted(os.listdir(checkpoint_dir)) == sorted(["checkpoint", *(f"ckpt_{e}" for e in range(1, 13))])
    assert sorted(p for p in os.listdir(".") if p.startswith("mymodel_")) == sorted(f"mymodel_{e}" for e in range(1, 13))
    assert os.path.isdir("best.keras") and not any(p.startswith(".stratagem") for p in os.listdir("."))
    names = sorted(os.listdir("logs"))
    assert len(names) == 13 and names[0] == "checkpoint" and names[1].startswith("w-0001-") and names[-1].startswith("w-0012-")
    assert names[-1] == f"w-0012-{history.history['loss'][11]:.2f}.keras"  # the logs, as Keras formats them

    latest = sg.train.latest_checkpoint(checkpoint_dir)
    assert latest == os.path.join(checkpoint_dir, "ckpt_12")  # the newest save, not "ckpt_9"
    restored = _softmax_model(classes=3)
    sg.train.load_weights(restored, latest)  # model.load_weights(tf.train.latest_checkpoint(dir))
    for p, q in zip(restored.parameters(), model.parameters()):
        torch.testing.assert_close(p, q)
    assert sg.train.latest_checkpoint(tmp_path / "nothing") is None

    # without a state file (a CheckpointManager's directory): the highest saved step
    manager = sg.CheckpointManager(sg.Checkpoint(model=model), tmp_path / "managed", max_to_keep=None)
    for step in (9, 12):
        manager.save(step)
    assert sg.train.latest_checkpoint(tmp_path / "managed") == str(tmp_path / "managed" / "ckpt-12")

    bad = sg.callbacks.ModelCheckpoint(filepath="m-{val_loss:.2f}")
    with pytest.raises(KeyError, match="Failed to format this callback filepath"):
        sg.fit(model, optimizer, "sparse_categorical_crossentropy", [(x, y)], epochs=1, callbacks=[bad], verbose=0)


def test_early_stopping_verbose_prints_keras_messages(capsys):
    x, y = _xy(16, classes=3)
    model = _softmax_model(classes=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stop = sg.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1, verbose=1, restore_best_weights=True)
    history = sg.fit(model, optimizer, "sparse_categorical_crossentropy", [(x, y)], epochs=10, callbacks=[stop], verbose=0)
    assert len(history.history["loss"]) == 2
    out = capsys.readouterr().out
    assert "Restoring model weights from the end of the best epoch: 1." in out
    assert "Epoch 2: early stopping" in out


# --- under MirroredStrategy: the same programs, parity with one device ---------------------------------
@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    return semantics_reference(str(one)), [r.value for r in run_workers(semantics_worker, 2, args=(str(two),), timeout=200)]


def _same(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


@pytest.mark.timeout(240)
def test_keras_semantics_under_mirrored_strategy_match_one_device(mirrored):
    ref, workers = mirrored
    assert ref["stop_batch"]["epochs"] == 1 and ref["stop_batch"]["batches"] == [0, 1]
    assert ref["stop_epoch"]["epochs"] == 1
    assert ref["predict"].shape == (45, 3) and ref["predict_np"].shape == (45, 3)
    assert isinstance(ref["evaluate"], list) and len(ref["evaluate"]) == 2 and isinstance(ref["evaluate_loss"], float)
    assert ref["checkpoint"]["files"] == ["checkpoint", "ckpt_1", "ckpt_2"] and ref["checkpoint"]["latest"] == "ckpt_2"
    _same(ref["checkpoint"]["restored"], ref["keras_name"]["params"])
    for v in workers:
        assert v["checkpoint"]["files"] == ref["checkpoint"]["files"] and v["checkpoint"]["latest"] == "ckpt_2"
        _same(v["checkpoint"]["restored"], ref["keras_name"]["params"])
        for case in ("keras_name", "keras_loss"):
            _same(v[case]["params"], ref[case]["params"])
            for k, hist in ref[case]["history"].items():
                assert v[case]["history"][k] == pytest.approx(hist, rel=1e-5), (case, k)
        # only replica 1's callback asked; both replicas stopped where one device stops
        assert v["stop_batch"]["batches"] == [0, 1] and v["stop_batch"]["epochs"] == 1 and v["stop_batch"]["flag"]
        _same(v["stop_batch"]["params"], ref["stop_batch"]["params"])
        assert v["stop_epoch"]["epochs"] == 1
        _same(v["stop_epoch"]["params"], ref["stop_epoch"]["params"])
        torch.testing.assert_close(v["predict"], ref["predict"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v["predict_np"], ref["predict"], rtol=1e-5, atol=1e-6)
        assert v["evaluate"] == pytest.approx(ref["evaluate"], rel=1e-5)
        assert v["evaluate_loss"] == pytest.approx(ref["evaluate_loss"], rel=1e-5)
