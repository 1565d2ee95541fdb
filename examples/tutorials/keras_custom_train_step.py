"""keras-io's guide "Customizing what happens in fit() with PyTorch", in stratagem.

https://keras.io/guides/custom_train_step_in_torch/ (keras-team/keras-io
guides/custom_train_step_in_torch.py), section by section, with the guide's names: a
``train_step`` using ``compute_loss`` / ``trainable_weights`` / ``optimizer.apply`` /
``self.metrics``; the lower-level version with its own ``metrics`` property; ``sample_weight``
support; a ``test_step``; the GAN with ``compile(d_optimizer, g_optimizer, loss_fn)``.
``python examples/tutorials/keras_custom_train_step.py`` (``NUM_REPLICAS=2`` runs every model in
a ``MirroredStrategy`` of 2 CPU replicas; the script starts the second process itself).

What differs from the guide, each said where it happens (and in docs/TF_COVERAGE.md):
- ``keras.Input(shape=(32,))`` + ``layers.Dense(1)`` is ``nn.Linear(32, 1)`` in an
  ``sg.Sequential`` subclass, made after ``torch.manual_seed(0)``; the data is
  ``np.random.default_rng(0)`` and every fit passes ``shuffle=False``, so
  tests/test_keras_guides.py can compare each printed number with Keras 3's own;
- the GAN trains on scikit-learn's digits (8x8, no download) with a small generator and
  discriminator for them, and draws its noise with ``torch.randn`` (``keras.random.normal`` with a
  ``SeedGenerator``): its losses are not compared with Keras's, only checked to be finite;
- each model is made in ``strategy.scope()`` (the guide has no strategy).
"""

import os

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg

print = sg.print  # one process prints: the chief

NUM_REPLICAS = int(os.environ.get("NUM_REPLICAS", "1"))
strategy = sg.MirroredStrategy("cpu", num_replicas=NUM_REPLICAS) if NUM_REPLICAS > 1 else sg.get_strategy()
print(f"replicas: {[strategy.num_replicas_in_sync]}")


def show(tag, value):
    print(f"{tag}: {value!r}")


def history_of(h):
    return {k: [float(v) for v in vs] for k, vs in h.history.items()}


# --- A first simple example -------------------------------------------------------------------
class CustomModel(sg.Sequential):
    def train_step(self, data):
        # Unpack the data. Its structure depends on your model and
        # on what you pass to `fit()`.
        x, y = data

        # Call torch.nn.Module.zero_grad() to clear the leftover gradients
        # for the weights from the previous train step.
        self.zero_grad()

        # Compute loss
        y_pred = self(x, training=True)  # Forward pass
        loss = self.compute_loss(y=y, y_pred=y_pred)

        # Call torch.Tensor.backward() on the loss to compute gradients
        # for the weights.
        loss.backward()

        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]

        # Update weights
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)

        # Update metrics (includes the metric that tracks the loss)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)

        # Return a dict mapping metric names to current value
        # Note that it will include the loss (tracked in self.metrics).
        return {m.name: m.result() for m in self.metrics}


rng = np.random.default_rng(0)  # np.random.random
x = rng.random((1000, 32)).astype("float32")
y = rng.random((1000, 1)).astype("float32")
sw = rng.random((1000, 1)).astype("float32")

# Construct and compile an instance of CustomModel
torch.manual_seed(0)
with strategy.scope():
    model = CustomModel(nn.Linear(32, 1))  # keras.Input(shape=(32,)) -> Dense(1)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])

# Just use `fit` as usual
show("simple", history_of(model.fit(x, y, epochs=3, shuffle=False, verbose=0)))


# --- Going lower-level ------------------------------------------------------------------------
class CustomModel(sg.Sequential):  # noqa: F811 - the guide redefines it, section by section
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = sg.metrics.Mean(name="loss")
        self.mae_metric = sg.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = sg.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)  # Forward pass
        loss = self.loss_fn(y, y_pred)
        loss.backward()
        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)

        # Compute our own metrics
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {
            "loss": self.loss_tracker.result(),
            "mae": self.mae_metric.result(),
        }

    @property
    def metrics(self):
        # We list our `Metric` objects here so that `reset_states()` can be
        # called automatically at the start of each epoch
        # or at the start of `evaluate()`.
        return [self.loss_tracker, self.mae_metric]


torch.manual_seed(0)
with strategy.scope():
    model = CustomModel(nn.Linear(32, 1))
    # We don't pass a loss or metrics here.
    model.compile(optimizer="adam")

# Just use `fit` as usual -- you can use callbacks, etc.
show("lower-level", history_of(model.fit(x, y, epochs=5, shuffle=False, verbose=0)))


# --- Supporting sample_weight & class_weight --------------------------------------------------
class CustomModel(sg.Sequential):  # noqa: F811
    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)  # Forward pass
        loss = self.compute_loss(
            y=y,
            y_pred=y_pred,
            sample_weight=sample_weight,
        )
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


torch.manual_seed(0)
with strategy.scope():
    model = CustomModel(nn.Linear(32, 1))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])

# You can now use sample_weight argument
show("sample_weight", history_of(model.fit(x, y, sample_weight=sw, epochs=3, shuffle=False, verbose=0)))


# --- Providing your own evaluation step -------------------------------------------------------
class CustomModel(sg.Sequential):  # noqa: F811
    def test_step(self, data):
        # Unpack the data
        x, y = data
        # Compute predictions
        y_pred = self(x, training=False)
        # Updates the metrics tracking the loss
        loss = self.compute_loss(y=y, y_pred=y_pred)
        # Update the metrics.
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        # Return a dict mapping metric names to current value.
        # Note that it will include the loss (tracked in self.metrics).
        return {m.name: m.result() for m in self.metrics}


torch.manual_seed(0)
with strategy.scope():
    model = CustomModel(nn.Linear(32, 1))
    model.compile(loss="mse", metrics=["mae"])

# Evaluate with our custom test_step
show("test_step", [float(v) for v in model.evaluate(x, y, verbose=0)])


# --- Wrapping up: an end-to-end GAN example ---------------------------------------------------
# Create the discriminator (28x28x1 images in the guide; the digits are 1x8x8)
discriminator = sg.Sequential(  # keras.Sequential(..., name="discriminator")
    nn.Conv2d(1, 64, 3, stride=2, padding=1),  # layers.Conv2D(64, (3, 3), strides=(2, 2), padding="same")
    nn.LeakyReLU(negative_slope=0.2),
    nn.Conv2d(64, 128, 3, stride=2, padding=1),
    nn.LeakyReLU(negative_slope=0.2),
    nn.AdaptiveMaxPool2d(1), nn.Flatten(),  # layers.GlobalMaxPooling2D()
    nn.Linear(128, 1),
)

# Create the generator
latent_dim = 128
generator = sg.Sequential(  # keras.Sequential(..., name="generator")
    # We want to generate 128 coefficients to reshape into a 2x2x128 map (7x7x128 in the guide)
    nn.Linear(latent_dim, 2 * 2 * 128),
    nn.LeakyReLU(negative_slope=0.2),
    nn.Unflatten(1, (128, 2, 2)),  # layers.Reshape
    nn.ConvTranspose2d(128, 128, 4, stride=2, padding=1),  # Conv2DTranspose(128, (4, 4), strides=(2, 2), padding="same")
    nn.LeakyReLU(negative_slope=0.2),
    nn.ConvTranspose2d(128, 128, 4, stride=2, padding=1),
    nn.LeakyReLU(negative_slope=0.2),
    nn.Conv2d(128, 1, 7, padding=3), nn.Sigmoid(),  # Conv2D(1, (7, 7), padding="same", activation="sigmoid")
)


class GAN(sg.Model):
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
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        # Sample random points in the latent space
        batch_size = real_images.shape[0]
        random_latent_vectors = torch.randn(batch_size, self.latent_dim)  # keras.random.normal

        # Decode them to fake images
        generated_images = self.generator(random_latent_vectors)

        # Combine them with real images
        combined_images = torch.concat([generated_images, real_images], axis=0)

        # Assemble labels discriminating real from fake images
        labels = torch.concat([torch.ones((batch_size, 1)), torch.zeros((batch_size, 1))], axis=0)
        # Add random noise to the labels - important trick!
        labels += 0.05 * torch.rand(labels.shape)  # keras.random.uniform

        # Train the discriminator
        self.zero_grad()
        predictions = self.discriminator(combined_images)
        d_loss = self.loss_fn(labels, predictions)
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        # Sample random points in the latent space
        random_latent_vectors = torch.randn(batch_size, self.latent_dim)

        # Assemble labels that say "all real images"
        misleading_labels = torch.zeros((batch_size, 1))

        # Train the generator (note that we should *not* update the weights
        # of the discriminator)!
        self.zero_grad()
        predictions = self.discriminator(self.generator(random_latent_vectors))
        g_loss = self.loss_fn(misleading_labels, predictions)
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)

        # Update metrics and return their value.
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {
            "d_loss": self.d_loss_tracker.result(),
            "g_loss": self.g_loss_tracker.result(),
        }


# Prepare the dataset. We use both the training & test MNIST digits (here: scikit-learn's digits).
batch_size = 64
all_digits = load_digits().images.astype("float32") / 16.0
all_digits = np.reshape(all_digits, (-1, 1, 8, 8))
dataset = sg.data.Dataset.from_tensor_slices(torch.from_numpy(all_digits)).batch(batch_size)

torch.manual_seed(0)
with strategy.scope():
    gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
    gan.compile(
        d_optimizer=sg.optimizers.Adam(learning_rate=0.0003),
        g_optimizer=sg.optimizers.Adam(learning_rate=0.0003),
        loss_fn=sg.losses.BinaryCrossentropy(from_logits=True),
    )

# To limit the execution time, we only train on 5 batches (100 in the guide).
show("GAN", history_of(gan.fit(dataset.take(5), epochs=1, verbose=0)))
