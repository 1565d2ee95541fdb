"""Models and programs for tests/train/test_keras_overrides.py: keras-io's "Customizing what happens
in fit() with PyTorch", its train_step / test_step / predict_step overrides and its GAN, written for
stratagem as the guide writes them for Keras, on one device and on 2 CPU replicas."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

import stratagem as sg


def guide_train_step(self, data):
    """The guide's train_step, as written (sample weights supported); counts its calls."""
    type(self).calls["train_step"] += 1
    if len(data) == 3:
        x, y, sample_weight = data
    else:
        sample_weight = None
        x, y = data
    self.zero_grad()
    y_pred = self(x, training=True)
    loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
    loss.backward()
    trainable_weights = [v for v in self.trainable_weights]
    gradients = [v.value.grad for v in trainable_weights]
    with torch.no_grad():
        self.optimizer.apply(gradients, trainable_weights)
    for metric in self.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
    return {m.name: m.result() for m in self.metrics}


def guide_test_step(self, data):
    """The guide's test_step, as written; counts its calls."""
    type(self).calls["test_step"] += 1
    x, y = data
    y_pred = self(x, training=False)
    loss = self.compute_loss(y=y, y_pred=y_pred)
    for metric in self.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred)
    return {m.name: m.result() for m in self.metrics}


class CustomModel(sg.Sequential):
    """The guide's model with its own train_step (sample weights supported) and test_step."""

    calls = {"train_step": 0, "test_step": 0, "predict_step": 0}
    train_step = guide_train_step
    test_step = guide_test_step

    def predict_step(self, data):
        CustomModel.calls["predict_step"] += 1
        return super().predict_step(data) * 2.0


class LowerLevel(sg.Sequential):
    """The guide's "going lower-level": its own loss and metrics, compile(optimizer) only."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.loss_tracker = sg.metrics.Mean(name="loss")
        self.mae_metric = sg.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = sg.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.loss_fn(y, y_pred)
        loss.backward()
        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class Frozen(sg.Sequential):
    """A train_step that trains nothing: fit must leave the weights as they are."""

    def train_step(self, data):
        x, y = data
        return {"loss": self.compute_loss(y=y, y_pred=self(x))}


class GAN(sg.Model):
    """The guide's GAN: no forward, compile(d_optimizer, g_optimizer, loss_fn), two updates a step."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = sg.metrics.Mean(name="d_loss")
        self.g_loss_tracker = sg.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, (tuple, list)):
            real_images = real_images[0]
        batch_size = real_images.shape[0]
        random_latent_vectors = torch.randn(batch_size, self.latent_dim)
        generated_images = self.generator(random_latent_vectors)
        combined_images = torch.concat([generated_images, real_images], axis=0)
        labels = torch.concat([torch.ones((batch_size, 1)), torch.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * torch.rand(labels.shape)

        self.zero_grad()
        predictions = self.discriminator(combined_images)
        d_loss = self.loss_fn(labels, predictions)
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        random_latent_vectors = torch.randn(batch_size, self.latent_dim)
        misleading_labels = torch.zeros((batch_size, 1))
        self.zero_grad()
        predictions = self.discriminator(self.generator(random_latent_vectors))
        g_loss = self.loss_fn(misleading_labels, predictions)
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)

        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def data(n: int = 1000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.random((n, 32)).astype("float32"), rng.random((n, 1)).astype("float32"),
            rng.random((n, 1)).astype("float32"))


def custom_program(strategy: Any) -> dict[str, Any]:
    """The guide's CustomModel with (N, 1) sample weights, then evaluate and predict."""
    x, y, sw = data(1000)
    torch.manual_seed(0)
    with strategy.scope():
        model = CustomModel(nn.Linear(32, 1))
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    CustomModel.calls.update(train_step=0, test_step=0, predict_step=0)
    history = model.fit(x, y, sample_weight=sw, epochs=3, batch_size=48, shuffle=False, verbose=0)
    results = model.evaluate(x, y, batch_size=48, verbose=0)
    predictions = model.predict(x[:5], verbose=0)
    return {
        "history": dict(history.history),
        "evaluate": [float(v) for v in results],
        "predictions": predictions.detach().cpu(),
        "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "calls": dict(CustomModel.calls),
    }


def mirrored_custom() -> dict[str, Any]:
    return custom_program(sg.MirroredStrategy("cpu"))


@sg.register_keras_serializable(package="tests")
class Regressor(sg.Model):
    """A subclassed model with Keras's get_config: load_model rebuilds it without model=."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.width = width
        self.body = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, x):
        return self.body(x)

    def get_config(self):
        return {"width": self.width}


def save_load_program(strategy: Any, directory: str) -> dict[str, Any]:
    """TF's "save and load a model using a distribution strategy": fit, save("m.keras"), then one
    more epoch on the saved model and on load_model's: the two continue alike, bit for bit."""
    x, y, _ = data(400)
    torch.manual_seed(0)
    with strategy.scope():
        model = Regressor(16)
        model.compile(optimizer=sg.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    model.fit(x, y, epochs=2, batch_size=32, verbose=0)
    path = f"{directory}/m.keras"
    model.save(path)
    with strategy.scope():
        loaded = sg.load_model(path)
    assert type(loaded) is Regressor and loaded.width == 16
    torch.manual_seed(1)
    h_loaded = loaded.fit(x, y, epochs=1, batch_size=32, verbose=0).history
    torch.manual_seed(1)
    h_saved = model.fit(x, y, epochs=1, batch_size=32, verbose=0).history
    return {
        "loaded": dict(h_loaded), "saved": dict(h_saved),
        "loaded_params": {k: v.detach().clone() for k, v in loaded.state_dict().items()},
        "saved_params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "iterations": (loaded.optimizer.iterations, model.optimizer.iterations),
    }


def mirrored_save_load(directory: str) -> dict[str, Any]:
    return save_load_program(sg.MirroredStrategy("cpu"), directory)


def sharded_override_refused() -> str:
    """Under ShardedStrategy an own train_step is refused on every replica, naming why."""
    strategy = sg.ShardedStrategy()
    x, y, _ = data(64)
    with strategy.scope():
        model = CustomModel(nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 1))
        model.compile(optimizer="adam", loss="mse")
    try:
        model.fit(x, y, epochs=1, verbose=0)
    except ValueError as e:
        return str(e)
    return "no error"
