"""keras-io's guide "Writing your own callbacks", in stratagem.

https://keras.io/guides/writing_your_own_callbacks/ (keras-team/keras-io
guides/writing_your_own_callbacks.py), section by section, with the guide's names and prints.
``python examples/tutorials/keras_writing_callbacks.py`` (``NUM_REPLICAS=2``: each model in a
``MirroredStrategy`` of 2 CPU replicas, the script starting the second process itself).

What differs from the guide:
- MNIST (a download) is scikit-learn's digits: 64 inputs instead of 784, pixels / 16;
- ``keras.Sequential([Dense(1)])`` is ``sg.Sequential(nn.Linear(64, 1))`` made after
  ``torch.manual_seed(0)`` and the fits pass ``shuffle=False``, so tests/test_keras_guides.py
  compares the numbers with Keras 3's own; each callback also keeps what it saw (``seen``), printed
  as ``tag: literal`` lines for the test;
- what the guide prints once, the chief prints (``sg.print``).
"""

import os

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg

print = sg.print

NUM_REPLICAS = int(os.environ.get("NUM_REPLICAS", "1"))
strategy = sg.MirroredStrategy("cpu", num_replicas=NUM_REPLICAS) if NUM_REPLICAS > 1 else sg.get_strategy()
print(f"replicas: {[strategy.num_replicas_in_sync]}")


def show(tag, value):
    print(f"{tag}: {value!r}")


def as_written(what, call):
    """Run a call of the guide as written; where stratagem refuses it, say so on a ``MISSING:``
    line (tests/test_keras_guides.py holds these as known defects) and go on with the guide."""
    try:
        return call()
    except (AttributeError, TypeError, ValueError) as e:
        print(f"MISSING: {what}: {e}")
        return None


# Define the Keras model to add callbacks to
def get_model():
    torch.manual_seed(0)
    with strategy.scope():
        model = sg.Sequential(nn.Linear(64, 1))  # keras.Sequential(); model.add(keras.layers.Dense(1))
        model.compile(
            optimizer=sg.optimizers.RMSprop(learning_rate=0.1),
            loss="mean_squared_error",
            metrics=["mean_absolute_error"],
        )
    return model


# Load example MNIST data and pre-process it (the digits)
digits = load_digits()
x_train = digits.data[:1000].reshape(-1, 64).astype("float32") / 16.0
x_test = digits.data[1000:].reshape(-1, 64).astype("float32") / 16.0
y_train = digits.target[:1000].astype("float32")
y_test = digits.target[1000:].astype("float32")

# Limit the data to 1000 samples
x_train = x_train[:1000]
y_train = y_train[:1000]
x_test = x_test[:1000]
y_test = y_test[:1000]

seen = []


class CustomCallback(sg.callbacks.Callback):
    def on_train_begin(self, logs=None):
        keys = list(logs.keys())
        seen.append(("on_train_begin", keys))
        print(f"Starting training; got log keys: {keys}")

    def on_train_end(self, logs=None):
        keys = list(logs.keys())
        seen.append(("on_train_end", keys))
        print(f"Stop training; got log keys: {keys}")

    def on_epoch_begin(self, epoch, logs=None):
        keys = list(logs.keys())
        seen.append(("on_epoch_begin", epoch, keys))
        print(f"Start epoch {epoch} of training; got log keys: {keys}")

    def on_epoch_end(self, epoch, logs=None):
        keys = list(logs.keys())
        seen.append(("on_epoch_end", epoch, keys))
        print(f"End epoch {epoch} of training; got log keys: {keys}")

    def on_test_begin(self, logs=None):
        keys = list(logs.keys())
        seen.append(("on_test_begin", keys))
        print(f"Start testing; got log keys: {keys}")

    def on_test_end(self, logs=None):
        keys = list(logs.keys())
        seen.append(("on_test_end", keys))
        print(f"Stop testing; got log keys: {keys}")

    def on_predict_begin(self, logs=None):
        keys = list(logs.keys())
        seen.append(("on_predict_begin", keys))
        print(f"Start predicting; got log keys: {keys}")

    def on_predict_end(self, logs=None):
        keys = list(logs.keys())
        seen.append(("on_predict_end", keys))
        print(f"Stop predicting; got log keys: {keys}")

    def on_train_batch_begin(self, batch, logs=None):
        keys = list(logs.keys())
        seen.append(("on_train_batch_begin", batch, keys))
        print(f"...Training: start of batch {batch}; got log keys: {keys}")

    def on_train_batch_end(self, batch, logs=None):
        keys = list(logs.keys())
        seen.append(("on_train_batch_end", batch, keys))
        print(f"...Training: end of batch {batch}; got log keys: {keys}")

    def on_test_batch_begin(self, batch, logs=None):
        keys = list(logs.keys())
        seen.append(("on_test_batch_begin", batch, keys))
        print(f"...Evaluating: start of batch {batch}; got log keys: {keys}")

    def on_test_batch_end(self, batch, logs=None):
        keys = list(logs.keys())
        seen.append(("on_test_batch_end", batch, keys))
        print(f"...Evaluating: end of batch {batch}; got log keys: {keys}")

    def on_predict_batch_begin(self, batch, logs=None):
        keys = list(logs.keys())
        seen.append(("on_predict_batch_begin", batch, keys))
        print(f"...Predicting: start of batch {batch}; got log keys: {keys}")

    def on_predict_batch_end(self, batch, logs=None):
        keys = list(logs.keys())
        seen.append(("on_predict_batch_end", batch, keys))
        print(f"...Predicting: end of batch {batch}; got log keys: {keys}")


model = get_model()
model.fit(
    x_train,
    y_train,
    batch_size=128,
    epochs=1,
    verbose=0,
    validation_split=0.5,
    callbacks=[CustomCallback()],
    shuffle=False,
)

res = as_written("evaluate(callbacks=)", lambda: model.evaluate(
    x_test, y_test, batch_size=128, verbose=0, callbacks=[CustomCallback()]))

res = as_written("predict(callbacks=)", lambda: model.predict(
    x_test, batch_size=128, callbacks=[CustomCallback()], verbose=0))
show("CustomCallback", seen)

losses = []


class LossAndErrorPrintingCallback(sg.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        losses.append(("train", batch, float(logs["loss"])))
        print(f"Up to batch {batch}, the average loss is {logs['loss']:7.2f}.")

    def on_test_batch_end(self, batch, logs=None):
        losses.append(("test", batch, float(logs["loss"])))
        print(f"Up to batch {batch}, the average loss is {logs['loss']:7.2f}.")

    def on_epoch_end(self, epoch, logs=None):
        losses.append(("epoch", epoch, float(logs["loss"]), float(logs["mean_absolute_error"])))
        print(
            "The average loss for epoch {} is {:7.2f} "
            "and mean absolute error is {:7.2f}.".format(epoch, logs["loss"], logs["mean_absolute_error"])
        )


model = get_model()
model.fit(x_train, y_train, batch_size=128, epochs=2, verbose=0, callbacks=[LossAndErrorPrintingCallback()],
          shuffle=False)

res = as_written("evaluate(callbacks=)", lambda: model.evaluate(
    x_test, y_test, batch_size=128, verbose=0, callbacks=[LossAndErrorPrintingCallback()]))
show("LossAndErrorPrintingCallback", losses)


class EarlyStoppingAtMinLoss(sg.callbacks.Callback):
    """Stop training when the loss is at its min, i.e. the loss stops decreasing.

    Arguments:
        patience: Number of epochs to wait after min has been hit. After this
        number of no improvement, training stops.
    """

    def __init__(self, patience=0):
        super().__init__()
        self.patience = patience
        # best_weights to store the weights at which the minimum loss occurs.
        self.best_weights = None

    def on_train_begin(self, logs=None):
        # The number of epoch it has waited when loss is no longer minimum.
        self.wait = 0
        # The epoch the training stops at.
        self.stopped_epoch = 0
        # Initialize the best as infinity.
        self.best = np.inf

    def on_epoch_end(self, epoch, logs=None):
        current = logs.get("loss")
        if np.less(current, self.best):
            self.best = current
            self.wait = 0
            # Record the best weights if current results is better (less).
            self.best_weights = self.model.get_weights()
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stopped_epoch = epoch
                self.model.stop_training = True
                print("Restoring model weights from the end of the best epoch.")
                self.model.set_weights(self.best_weights)

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping")


losses.clear()
model = get_model()
early = EarlyStoppingAtMinLoss()
model.fit(
    x_train,
    y_train,
    batch_size=64,
    steps_per_epoch=5,
    epochs=30,
    verbose=0,
    callbacks=[LossAndErrorPrintingCallback(), early],
    shuffle=False,
)
show("EarlyStoppingAtMinLoss", losses)
show("stopped_epoch", [early.stopped_epoch])
show("weights after early stopping", [w.tolist() for w in model.get_weights()])


class CustomLearningRateScheduler(sg.callbacks.Callback):
    """Learning rate scheduler which sets the learning rate according to schedule.

    Arguments:
        schedule: a function that takes an epoch index
            (integer, indexed from 0) and current learning rate
            as inputs and returns a new learning rate as output (float).
    """

    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule

    def on_epoch_begin(self, epoch, logs=None):
        if not hasattr(self.model.optimizer, "learning_rate"):
            raise ValueError('Optimizer must have a "learning_rate" attribute.')
        # Get the current learning rate from model's optimizer.
        lr = self.model.optimizer.learning_rate
        # Call schedule function to get the scheduled learning rate.
        scheduled_lr = self.schedule(epoch, lr)
        # Set the value back to the optimizer before this epoch starts
        as_written("optimizer.learning_rate = value", lambda: setattr(self.model.optimizer, "learning_rate", scheduled_lr))
        rates.append(float(np.array(scheduled_lr)))
        print(f"\nEpoch {epoch}: Learning rate is {float(np.array(scheduled_lr))}.")


LR_SCHEDULE = [
    # (epoch to start, learning rate) tuples
    (3, 0.05),
    (6, 0.01),
    (9, 0.005),
    (12, 0.001),
]


def lr_schedule(epoch, lr):
    """Helper function to retrieve the scheduled learning rate based on epoch."""
    if epoch < LR_SCHEDULE[0][0] or epoch > LR_SCHEDULE[-1][0]:
        return lr
    for i in range(len(LR_SCHEDULE)):
        if epoch == LR_SCHEDULE[i][0]:
            return LR_SCHEDULE[i][1]
    return lr


losses.clear()
rates = []
model = get_model()
model.fit(
    x_train,
    y_train,
    batch_size=64,
    steps_per_epoch=5,
    epochs=15,
    verbose=0,
    callbacks=[
        LossAndErrorPrintingCallback(),
        CustomLearningRateScheduler(lr_schedule),
    ],
    shuffle=False,
)
show("CustomLearningRateScheduler", losses)
show("learning rates", rates)
