"""Keras and tf.distribute habits on 2 replicas: the replica-context API (all_gather, merge_call,
values from a function, regularization scaling) and fit's options (string losses and metrics,
gradient accumulation with one all-reduce per update, clipping, class weights)."""

from __future__ import annotations

import pytest
import torch
from keras_workers import keras_reference, keras_worker

import stratagem as sg
from stratagem.testing import run_workers


def _same(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


@pytest.fixture(scope="module")
def results():
    return keras_reference(), [r.value for r in run_workers(keras_worker, 2, timeout=200)]


@pytest.mark.timeout(240)
def test_fit_options_match_one_device(results):
    ref, workers = results
    for v in workers:
        for case in ("accumulate", "clip", "class_weight", "binary_mse"):
            _same(v[case]["params"], ref[case]["params"])
            for k, hist in ref[case]["history"].items():
                assert v[case]["history"][k] == pytest.approx(hist, rel=1e-5), (case, k)
        # 3 accumulated batches of 8 are one update on the batch of 24
        _same(ref["accumulate"]["params"], ref["big_batch"]["params"])
        assert v["bucket_reduces"] == 2  # one gradient all-reduce per update, not per batch
        assert "accuracy" in v["binary_mse"]["history"] and "mae" in v["binary_mse"]["history"]  # Keras logs a metric given by name under that name


@pytest.mark.timeout(240)
def test_replica_context_api_has_tf_semantics(results):
    _, workers = results
    for r, v in enumerate(workers):
        api = v["api"]
        assert api["gathered"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]  # replica 0's 1 row, replica 1's 2 rows
        assert api["merged"] == (1.0 + 2.0) * 10  # merge_fn saw both replicas' values, once
        assert api["value"] == [10 * r] and api["local"] == 2  # tf: a PerReplica of both replicas
        _same(v["reg"], v["reg_ref"])  # the L2 penalty counts once, as on one device


def test_keras_names_and_option_errors():
    from stratagem.train.loss_names import resolve

    with pytest.raises(ValueError, match="unknown loss 'msee'"):
        resolve("msee")
    acc = sg.metrics.get("accuracy")
    acc.update_state(torch.tensor([0, 2]), torch.tensor([[3.0, 0, 0], [0, 0, 1]]))  # sparse
    assert float(acc.result()) == 1.0
    acc.reset_state()
    acc.update_state(torch.tensor([[1.0], [0.0]]), torch.tensor([[0.9], [0.7]]))  # binary
    assert float(acc.result()) == 0.5
    acc.reset_state()
    acc.update_state(torch.tensor([[0, 1.0], [1.0, 0]]), torch.tensor([[0.2, 0.8], [0.1, 0.9]]))  # one-hot
    assert float(acc.result()) == 0.5
    from stratagem.train.steps import TrainOptions

    with pytest.raises(ValueError, match="gradient_accumulation_steps must be a positive integer"):
        TrainOptions(accumulate=0)
    with pytest.raises(ValueError, match="clipnorm must be > 0"):
        TrainOptions(clipnorm=-1.0)


def test_model_checkpoint_takes_keras_filepath(tmp_path):
    from torch import nn

    from stratagem.callbacks import ModelCheckpoint
    from stratagem.data import Dataset
    from stratagem.train.checkpoint import load_state_dict

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
    s = sg.OneDeviceStrategy("cpu")
    with s.scope():
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cb = ModelCheckpoint(filepath=str(tmp_path / "ck" / "model-{epoch:02d}.keras"), monitor="loss", save_weights_only=True)
    sg.fit(model, opt, sg.losses.SparseCategoricalCrossentropy(from_logits=True), Dataset.from_tensor_slices((x, y)).batch(8),
           epochs=2, callbacks=[cb], verbose=0)
    # Keras's filepath, formatted per save: exactly those paths (and TF's state file)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["checkpoint", "model-01.keras", "model-02.keras"]
    assert cb.last_path == str(tmp_path / "ck" / "model-02.keras")
    weights = load_state_dict(cb.last_path, name="model")
    torch.testing.assert_close(weights["weight"], model.weight.detach())
    with pytest.raises(Exception, match="optimizer"):  # save_weights_only: no optimizer state kept
        load_state_dict(cb.last_path, name="optimizer")
    with pytest.raises(ValueError, match="exactly one"):
        ModelCheckpoint()
