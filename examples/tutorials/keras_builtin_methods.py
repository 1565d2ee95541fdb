"""Keras's guide "Training & evaluation with the built-in methods", in stratagem.

https://keras.io/guides/training_with_built_in_methods/ (keras-team/keras-io
guides/training_with_built_in_methods.py), section by section, with the guide's names. Keras
layers are swapped for torch.nn ones, ``import tensorflow as tf`` / ``keras`` for ``import
stratagem as sg``, and MNIST (a download) for scikit-learn's digits (8x8 images shipped with the
package: 64 inputs instead of 784). ``python examples/tutorials/keras_builtin_methods.py``.

What differs from the guide, each said where it happens (and in docs/TF_COVERAGE.md):
- every model is made after ``torch.manual_seed(0)`` and the array fits pass ``shuffle=False``,
  so tests/test_tutorials.py can compare the numbers printed here with Keras 3's own (which
  shuffles with other permutations);
- losses and metrics added inside a layer (``add_loss``, ``add_metric``) do not exist: the
  end-point layer is written as a model returning its own ``"loss"``;
- a custom metric implements ``batch_totals`` (stratagem's streaming form) instead of
  ``add_weight`` / ``assign_add``;
- the multi-output model returns a dict, so its per-output losses are given by name.
"""

import os

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg

CHECKPOINT_DIR = os.environ.get("CHECKPOINT_DIR", ".")


def show(tag, history):
    """One line per fit: its History, for the test to compare with Keras's."""
    print(f"{tag}: {dict(history.history)}")


# --- API overview: a first end-to-end example ---------------------------------------------------
def get_uncompiled_model():
    torch.manual_seed(0)  # the test gives Keras these initial weights
    return sg.Sequential(
        nn.Linear(64, 64), nn.ReLU(),  # layers.Dense(64, activation="relu", name="dense_1")
        nn.Linear(64, 64), nn.ReLU(),  # layers.Dense(64, activation="relu", name="dense_2")
        nn.Linear(64, 10), nn.Softmax(dim=-1),  # layers.Dense(10, activation="softmax", name="predictions")
    )


model = get_uncompiled_model()

digits = load_digits()
x_train, x_test = digits.data[:1500], digits.data[1500:]
y_train, y_test = digits.target[:1500], digits.target[1500:]

# Preprocess the data (these are NumPy arrays)
x_train = x_train.reshape(1500, 64).astype("float32") / 16
x_test = x_test.reshape(len(x_test), 64).astype("float32") / 16

y_train = y_train.astype("float32")
y_test = y_test.astype("float32")

# Reserve 300 samples for validation
x_val = x_train[-300:]
y_val = y_train[-300:]
x_train = x_train[:-300]
y_train = y_train[:-300]

model.compile(
    optimizer=sg.optimizers.RMSprop(),  # Optimizer
    # Loss function to minimize
    loss=sg.losses.SparseCategoricalCrossentropy(),
    # List of metrics to monitor
    metrics=[sg.metrics.SparseCategoricalAccuracy()],
)

print("Fit model on training data")
history = model.fit(
    x_train,
    y_train,
    batch_size=64,
    epochs=2,
    # We pass some validation for
    # monitoring validation loss and metrics
    # at the end of each epoch
    validation_data=(x_val, y_val),
    shuffle=False,
)
show("history.history", history)

# Evaluate the model on the test data using `evaluate`
print("Evaluate on test data")
results = model.evaluate(x_test, y_test, batch_size=128)
print("test loss, test acc:", results)

# Generate predictions (probabilities -- the output of the last layer)
# on new data using `predict`
print("Generate predictions for 3 samples")
predictions = model.predict(x_test[:3])
print("predictions shape:", tuple(predictions.shape))
print("predictions:", predictions.tolist())


# --- The compile() method: specifying a loss, metrics, and an optimizer ----------------------------
model.compile(
    optimizer=sg.optimizers.RMSprop(learning_rate=1e-3),
    loss=sg.losses.SparseCategoricalCrossentropy(),
    metrics=[sg.metrics.SparseCategoricalAccuracy()],
)

model.compile(
    optimizer="rmsprop",
    loss="sparse_categorical_crossentropy",
    metrics=["sparse_categorical_accuracy"],
)


def get_compiled_model():
    model = get_uncompiled_model()
    model.compile(
        optimizer="rmsprop",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )
    return model


# --- Custom losses ------------------------------------------------------------------------------
def custom_mean_squared_error(y_true, y_pred):
    # a plain function is called as a torch loss, (outputs, y): this one is symmetric
    return torch.mean(torch.square(y_true - y_pred))


model = get_uncompiled_model()
model.compile(optimizer=sg.optimizers.Adam(), loss=custom_mean_squared_error)

# We need to one-hot encode the labels to use MSE
y_train_one_hot = nn.functional.one_hot(torch.as_tensor(y_train).long(), num_classes=10).float()
show("custom_mean_squared_error", model.fit(x_train, y_train_one_hot, batch_size=64, epochs=1, shuffle=False))


class CustomMSE(sg.losses.Loss):
    def __init__(self, regularization_factor=0.1, name="custom_mse"):
        super().__init__(name=name)
        self.regularization_factor = regularization_factor

    def call(self, y_true, y_pred):
        mse = torch.mean(torch.square(y_true - y_pred))
        reg = torch.mean(torch.square(0.5 - y_pred))
        return mse + reg * self.regularization_factor


model = get_uncompiled_model()
model.compile(optimizer=sg.optimizers.Adam(), loss=CustomMSE())

y_train_one_hot = nn.functional.one_hot(torch.as_tensor(y_train).long(), num_classes=10).float()
show("CustomMSE", model.fit(x_train, y_train_one_hot, batch_size=64, epochs=1, shuffle=False))


# --- Custom metrics -----------------------------------------------------------------------------
class CategoricalTruePositives(sg.metrics.Metric):
    # Keras: self.true_positives = self.add_weight(name="ctp", initializer="zeros"), update_state
    # assign_adds to it. stratagem's metric state is float64 totals summed across replicas:
    # batch_totals gives one batch's, compute turns the totals into the result.
    num_totals = 1
    additive = True

    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)

    def batch_totals(self, y_true, y_pred, sample_weight=None):
        y_pred = torch.reshape(torch.argmax(y_pred, dim=1), shape=(-1, 1))
        values = y_true.to(torch.int32).reshape(-1, 1) == y_pred.to(torch.int32)
        values = values.to(torch.float32)
        if sample_weight is not None:
            values = values * sample_weight.to(torch.float32).reshape(-1, 1)
        return values.sum().reshape(1)

    def compute(self, totals):
        return totals[0]  # result(): the true positives


model = get_uncompiled_model()
model.compile(
    optimizer=sg.optimizers.RMSprop(learning_rate=1e-3),
    loss=sg.losses.SparseCategoricalCrossentropy(),
    metrics=[CategoricalTruePositives()],
)
show("CategoricalTruePositives", model.fit(x_train, y_train, batch_size=64, epochs=3, shuffle=False))


# --- Handling losses and metrics that don't fit the standard signature ---------------------------
# Layer.add_loss / add_metric / Model.add_loss have no stratagem form (MISSING): a torch module
# has no per-call loss collection. A model can return its own loss instead: compiled with no
# loss, fit minimizes its output's "loss" (Keras's end-point layer below).
class LogisticEndpoint(nn.Module):
    def __init__(self, name=None):
        super().__init__()
        self.loss_fn = sg.losses.BinaryCrossentropy(from_logits=True)

    def forward(self, targets, logits, sample_weights=None):
        # Compute the training-time loss value: returned with the outputs as "loss"
        loss = self.loss_fn(targets, logits, sample_weights)
        # Return the inference-time prediction tensor (for `.predict()`).
        return {"loss": loss, "logits": torch.softmax(logits, dim=-1)}


class EndpointModel(sg.Model):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(3, 10)  # keras.layers.Dense(10)
        self.predictions = LogisticEndpoint(name="predictions")

    def forward(self, inputs, targets):
        logits = self.dense(inputs)
        return self.predictions(targets, logits)


torch.manual_seed(0)
model = EndpointModel()
model.compile(optimizer="adam")  # No loss argument!

data = {
    "inputs": np.random.default_rng(0).random((3, 3)),
    "targets": np.random.default_rng(1).random((3, 10)),
}
show("LogisticEndpoint", model.fit(data))


# --- Automatically setting apart a validation holdout set ----------------------------------------
model = get_compiled_model()
show("validation_split", model.fit(x_train, y_train, batch_size=64, validation_split=0.2, epochs=1, shuffle=False))


# --- Training & evaluation from tf.data Datasets -------------------------------------------------
model = get_compiled_model()

# First, let's create a training Dataset instance.
# For the sake of our example, we'll use the same digits data as before.
train_dataset = sg.data.Dataset.from_tensor_slices((x_train, y_train))
# Shuffle and slice the dataset.
train_dataset = train_dataset.shuffle(buffer_size=1024, seed=0).batch(64)

# Now we get a test dataset.
test_dataset = sg.data.Dataset.from_tensor_slices((x_test, y_test))
test_dataset = test_dataset.batch(64)

# Since the dataset already takes care of batching,
# we don't pass a `batch_size` argument.
show("Dataset", model.fit(train_dataset, epochs=3))

# You can also evaluate or predict on a dataset.
print("Evaluate")
result = model.evaluate(test_dataset)
print("evaluate(test_dataset):", dict(zip(model.metrics_names, result)))

model = get_compiled_model()

# Prepare the training dataset
train_dataset = sg.data.Dataset.from_tensor_slices((x_train, y_train))
train_dataset = train_dataset.shuffle(buffer_size=1024, seed=0).batch(64)

# Only use the 10 batches per epoch (that's 64 * 10 samples)
show("steps_per_epoch", model.fit(train_dataset, epochs=3, steps_per_epoch=10))

# Using a validation dataset
model = get_compiled_model()

# Prepare the training dataset
train_dataset = sg.data.Dataset.from_tensor_slices((x_train, y_train))
train_dataset = train_dataset.shuffle(buffer_size=1024, seed=0).batch(64)

# Prepare the validation dataset
val_dataset = sg.data.Dataset.from_tensor_slices((x_val, y_val))
val_dataset = val_dataset.batch(64)

show("validation_data=val_dataset", model.fit(train_dataset, epochs=1, validation_data=val_dataset))

model = get_compiled_model()

# Prepare the training dataset
train_dataset = sg.data.Dataset.from_tensor_slices((x_train, y_train))
train_dataset = train_dataset.shuffle(buffer_size=1024, seed=0).batch(64)

# Prepare the validation dataset
val_dataset = sg.data.Dataset.from_tensor_slices((x_val, y_val))
val_dataset = val_dataset.batch(64)

history = model.fit(
    train_dataset,
    epochs=1,
    # Only run validation using the first 2 batches of the dataset
    # using the `validation_steps` argument
    validation_data=val_dataset,
    validation_steps=2,
)
show("validation_steps", history)


# --- Using sample weighting and class weighting -------------------------------------------------
class_weight = {
    0: 1.0,
    1: 1.0,
    2: 1.0,
    3: 1.0,
    4: 1.0,
    # Set weight "2" for class "5",
    # making this class 2x more important
    5: 2.0,
    6: 1.0,
    7: 1.0,
    8: 1.0,
    9: 1.0,
}

print("Fit with class weight")
model = get_compiled_model()
show("class_weight", model.fit(x_train, y_train, class_weight=class_weight, batch_size=64, epochs=1, shuffle=False))

sample_weight = np.ones(shape=(len(y_train),))
sample_weight[y_train == 5] = 2.0

print("Fit with sample weight")
model = get_compiled_model()
show("sample_weight", model.fit(x_train, y_train, sample_weight=sample_weight, batch_size=64, epochs=1, shuffle=False))

sample_weight = np.ones(shape=(len(y_train),))
sample_weight[y_train == 5] = 2.0

# Create a Dataset that includes sample weights
# (3rd element in the return tuple).
train_dataset = sg.data.Dataset.from_tensor_slices((x_train, y_train, sample_weight))

# Shuffle and slice the dataset.
train_dataset = train_dataset.shuffle(buffer_size=1024, seed=0).batch(64)

model = get_compiled_model()
show("sample_weight Dataset", model.fit(train_dataset, epochs=1))


# --- Passing data to multi-input, multi-output models ----------------------------------------------
# Images are channels-first as torch's Conv2d takes them: (3, 32, 32), not (32, 32, 3).
class MultiInputOutputModel(sg.Model):
    def __init__(self):
        super().__init__()
        self.conv2d = nn.Conv2d(3, 3, 3)  # layers.Conv2D(3, 3)
        self.conv1d = nn.Conv1d(10, 3, 3)  # layers.Conv1D(3, 3)
        self.score_output = nn.Linear(6, 1)  # layers.Dense(1, name="score_output")
        self.class_output = nn.Linear(6, 5)  # layers.Dense(5, name="class_output")

    def forward(self, img_input, ts_input=None):
        if ts_input is None:  # called with the list [img_input, ts_input]
            img_input, ts_input = img_input
        x1 = self.conv2d(img_input).amax(dim=(2, 3))  # layers.GlobalMaxPooling2D()
        x2 = self.conv1d(ts_input.transpose(1, 2)).amax(dim=2)  # (timesteps, features) in, GlobalMaxPooling1D()
        x = torch.cat([x1, x2], dim=1)  # layers.concatenate([x1, x2])
        # Keras's outputs=[score_output, class_output]: by name, so losses are given by name
        return {"score_output": self.score_output(x), "class_output": self.class_output(x)}


torch.manual_seed(0)
model = MultiInputOutputModel()

# keras.utils.plot_model: no stratagem form (print(model) shows the layers)

# a list of losses maps onto a model returning a list/tuple of outputs; this model returns a
# dict (Keras's named outputs), so its losses and metrics are given by name
model.compile(
    optimizer=sg.optimizers.RMSprop(1e-3),
    loss={
        "score_output": sg.losses.MeanSquaredError(),
        "class_output": sg.losses.CategoricalCrossentropy(from_logits=True),
    },
    metrics={
        "score_output": [sg.metrics.MeanAbsolutePercentageError(), sg.metrics.MeanAbsoluteError()],
        "class_output": [sg.metrics.CategoricalAccuracy()],
    },
)

model.compile(
    optimizer=sg.optimizers.RMSprop(1e-3),
    loss={
        "score_output": sg.losses.MeanSquaredError(),
        "class_output": sg.losses.CategoricalCrossentropy(from_logits=True),
    },
    metrics={
        "score_output": [sg.metrics.MeanAbsolutePercentageError(), sg.metrics.MeanAbsoluteError()],
        "class_output": [sg.metrics.CategoricalAccuracy()],
    },
    loss_weights={"score_output": 2.0, "class_output": 1.0},
)

# Or dict loss version (no loss for the score output)
model.compile(
    optimizer=sg.optimizers.RMSprop(1e-3),
    loss={"class_output": sg.losses.CategoricalCrossentropy(from_logits=True)},
)

model.compile(
    optimizer=sg.optimizers.RMSprop(1e-3),
    loss={"score_output": sg.losses.MeanSquaredError(), "class_output": sg.losses.CategoricalCrossentropy(from_logits=True)},
    loss_weights={"score_output": 2.0, "class_output": 1.0},
)

# Generate dummy NumPy data
rng = np.random.default_rng(0)
img_data = rng.random(size=(100, 3, 32, 32)).astype("float32")
ts_data = rng.random(size=(100, 20, 10)).astype("float32")
score_targets = rng.random(size=(100, 1)).astype("float32")
class_targets = rng.random(size=(100, 5)).astype("float32")
class_targets /= class_targets.sum(axis=1, keepdims=True)  # a distribution per example

# Fit on lists (the targets by name: the outputs are named)
show("multi-output lists", model.fit(
    [img_data, ts_data], {"score_output": score_targets, "class_output": class_targets},
    batch_size=32, epochs=1, shuffle=False,
))

# Alternatively, fit on dicts
show("multi-output dicts", model.fit(
    {"img_input": img_data, "ts_input": ts_data},
    {"score_output": score_targets, "class_output": class_targets},
    batch_size=32,
    epochs=1,
    shuffle=False,
))

train_dataset = sg.data.Dataset.from_tensor_slices(
    (
        {"img_input": img_data, "ts_input": ts_data},
        {"score_output": score_targets, "class_output": class_targets},
    )
)
train_dataset = train_dataset.shuffle(buffer_size=1024, seed=0).batch(64)

show("multi-output Dataset", model.fit(train_dataset, epochs=1))


# --- Using callbacks -----------------------------------------------------------------------------
model = get_compiled_model()

callbacks = [
    sg.callbacks.EarlyStopping(
        # Stop training when `val_loss` is no longer improving
        monitor="val_loss",
        # "no longer improving" being defined as "no better than 1e-2 less"
        min_delta=1e-2,
        # "no longer improving" being further defined as "for at least 2 epochs"
        patience=2,
        verbose=1,
    )
]
show("EarlyStopping", model.fit(
    x_train,
    y_train,
    epochs=20,
    batch_size=64,
    callbacks=callbacks,
    validation_split=0.2,
    shuffle=False,
))


class LossHistory(sg.callbacks.Callback):
    def on_train_begin(self, logs):
        self.per_batch_losses = []

    def on_batch_end(self, batch, logs):
        self.per_batch_losses.append(logs.get("loss"))


model = get_compiled_model()
loss_history = LossHistory()
model.fit(x_train, y_train, batch_size=64, epochs=1, callbacks=[loss_history], shuffle=False)
print("per_batch_losses:", loss_history.per_batch_losses)


# --- Checkpointing models ------------------------------------------------------------------------
model = get_compiled_model()

callbacks = [
    sg.callbacks.ModelCheckpoint(
        # Path where to save the model
        # The two parameters below mean that we will overwrite
        # the current checkpoint if and only if
        # the `val_loss` score has improved.
        # The saved model name will include the current epoch.
        filepath=os.path.join(CHECKPOINT_DIR, "mymodel_{epoch}.keras"),
        save_best_only=True,  # Only save a model if `val_loss` has improved.
        monitor="val_loss",
        verbose=1,
    )
]
model.fit(x_train, y_train, epochs=2, batch_size=64, callbacks=callbacks, validation_split=0.2, shuffle=False)

# Prepare a directory to store all the checkpoints.
checkpoint_dir = os.path.join(CHECKPOINT_DIR, "ckpt")
if not os.path.exists(checkpoint_dir):
    os.makedirs(checkpoint_dir)


def make_or_restore_model():
    # Either restore the latest model, or create a fresh one
    # if there is no checkpoint available.
    checkpoints = [checkpoint_dir + "/" + name for name in os.listdir(checkpoint_dir) if name != "checkpoint"]
    if checkpoints:
        latest_checkpoint = max(checkpoints, key=os.path.getctime)
        print("Restoring from", latest_checkpoint)
        # the architecture is code: load_model rebuilds the weights into the model given
        model = get_compiled_model()
        model.load_weights(latest_checkpoint)
        return model
    print("Creating a new model")
    return get_compiled_model()


for _run in range(2):  # the second run restores what the first saved
    model = make_or_restore_model()
    callbacks = [
        # This callback saves the model every 10 batches.
        # We include the training loss in the saved model name.
        sg.callbacks.ModelCheckpoint(filepath=checkpoint_dir + "/ckpt-loss={loss:.2f}", save_freq=10)
    ]
    model.fit(x_train, y_train, epochs=1, callbacks=callbacks, shuffle=False)
print("checkpoints:", sorted(os.listdir(checkpoint_dir)))


# --- Using learning rate schedules ---------------------------------------------------------------
initial_learning_rate = 0.1
lr_schedule = sg.optimizers.schedules.ExponentialDecay(
    initial_learning_rate, decay_steps=100000, decay_rate=0.96, staircase=True
)

optimizer = sg.optimizers.RMSprop(learning_rate=lr_schedule)

model = get_uncompiled_model()
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["sparse_categorical_accuracy"])
show("ExponentialDecay", model.fit(x_train, y_train, batch_size=64, epochs=1, shuffle=False))


# --- Visualizing loss and metrics during training ------------------------------------------------
try:
    sg.callbacks.TensorBoard(
        log_dir=os.path.join(CHECKPOINT_DIR, "logs"),
        histogram_freq=0,  # How often to log histogram visualizations
        embeddings_freq=0,  # How often to log embedding visualizations
        update_freq="epoch",
    )  # How often to write logs (default: once per epoch)
    print("TensorBoard: ready")
except ImportError as e:  # the tensorboard package is not installed
    print(f"TensorBoard: {e}")
