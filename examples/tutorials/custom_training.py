"""TensorFlow's tutorial "Custom training with tf.distribute.Strategy", in stratagem.

https://www.tensorflow.org/tutorials/distribute/custom_training, cell by cell, with its names:
a MirroredStrategy, global batches split across replicas, a loss object with reduction NONE,
``compute_average_loss`` plus ``scale_regularization_loss`` for the model's L2 losses, metrics
updated inside ``strategy.run``, a checkpoint every other epoch, the restore without a strategy,
then the two other ways of iterating (an iterator, a whole epoch in one function).

Fashion-MNIST (a download) is replaced by scikit-learn's digits (shipped with the package),
scaled up to 16x16 so the tutorial's two conv/pool blocks fit. Keras layers are torch.nn ones,
channels first. ``python examples/tutorials/custom_training.py`` starts its second replica itself
(``NUM_REPLICAS=1`` runs it on one device: the test compares the two).
"""

# Import stratagem
import os

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg

# --- Download the Fashion MNIST dataset (here: scikit-learn's digits) --------------------------------
digits = load_digits()
images = digits.images.astype(np.float32).repeat(2, axis=1).repeat(2, axis=2)  # 16 x 16
(train_images, train_labels), (test_images, test_labels) = (
    (images[:1500], digits.target[:1500]), (images[1500:], digits.target[1500:]))  # fmt: skip

# Add a dimension to the array -> new shape == (1, 16, 16): torch's Conv2d takes channels first
train_images = train_images[:, None, ...]
test_images = test_images[:, None, ...]

# Scale the images to the [0, 1] range.
train_images = train_images / np.float32(16)
test_images = test_images / np.float32(16)

# --- Create a strategy to distribute the variables and the graph -------------------------------------
# tf.distribute.MirroredStrategy() finds the GPUs; on CPU, 2 replicas are asked for explicitly
strategy = sg.MirroredStrategy("cpu", num_replicas=int(os.environ.get("NUM_REPLICAS", "2")))
sg.print("Number of devices: {}".format(strategy.num_replicas_in_sync))

# --- Setup input pipeline ------------------------------------------------------------------------
BUFFER_SIZE = len(train_images)

BATCH_SIZE_PER_REPLICA = 64 // strategy.num_replicas_in_sync  # a global batch of 64 on any number
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

EPOCHS = 4

train_dataset = sg.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(BUFFER_SIZE, seed=0).batch(GLOBAL_BATCH_SIZE)
test_dataset = sg.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)


# --- Create the model ----------------------------------------------------------------------------
class L2Sequential(nn.Sequential):
    """tf.keras.Sequential with kernel_regularizer=tf.keras.regularizers.L2(1e-5) on every layer:
    ``model.losses`` is the list of each kernel's ``1e-5 * sum(w ** 2)``."""

    regularizer = 1e-5

    @property
    def losses(self):
        return [self.regularizer * m.weight.square().sum() for m in self if isinstance(m, (nn.Conv2d, nn.Linear))]


def create_model():
    model = L2Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 2 * 2, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )  # fmt: skip
    return model


# Create a checkpoint directory to store the checkpoints.
checkpoint_dir = os.environ.get("CHECKPOINT_DIR", "./training_checkpoints")
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

# --- Define the loss function ----------------------------------------------------------------------
with strategy.scope():
    # Set reduction to `NONE` so you can do the reduction yourself.
    loss_object = sg.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=sg.losses.Reduction.NONE)

    def compute_loss(labels, predictions, model_losses):
        per_example_loss = loss_object(labels, predictions)
        loss = sg.compute_average_loss(per_example_loss)
        if model_losses:
            loss += sg.scale_regularization_loss(torch.stack(model_losses).sum())  # tf.add_n
        return loss


# --- Define the metrics to track loss and accuracy -------------------------------------------------
with strategy.scope():
    test_loss = sg.metrics.Mean(name="test_loss")

    train_accuracy = sg.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    test_accuracy = sg.metrics.SparseCategoricalAccuracy(name="test_accuracy")

# --- Training loop -----------------------------------------------------------------------------------
# A model, an optimizer, and a checkpoint must be created under `strategy.scope`.
with strategy.scope():
    torch.manual_seed(0)  # the same initial weights on any number of replicas
    model = create_model()

    optimizer = sg.optimizers.Adam(learning_rate=0.001).build(model.parameters())

    checkpoint = sg.Checkpoint(optimizer=optimizer, model=model)


def train_step(inputs):
    images, labels = inputs

    optimizer.zero_grad()  # tf.GradientTape: torch records the graph by itself
    predictions = model(images)
    loss = compute_loss(labels, predictions, model.losses)

    loss.backward()  # tape.gradient; the gradients are summed across replicas
    optimizer.step()  # optimizer.apply_gradients

    train_accuracy.update_state(labels, predictions.detach())
    return loss.detach()


def test_step(inputs):
    images, labels = inputs

    with torch.no_grad():  # model(images, training=False)
        predictions = model(images)
        t_loss = loss_object(labels, predictions)

    test_loss.update_state(t_loss)
    test_accuracy.update_state(labels, predictions)


# `run` replicates the provided computation and runs it
# with the distributed input.
def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(sg.ReduceOp.SUM, per_replica_losses, axis=None)


def distributed_test_step(dataset_inputs):
    return strategy.run(test_step, args=(dataset_inputs,))


for epoch in range(EPOCHS):
    # TRAIN LOOP
    total_loss = 0.0
    num_batches = 0
    for x in train_dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
    train_loss = total_loss / num_batches

    # TEST LOOP
    for x in test_dist_dataset:
        distributed_test_step(x)

    if epoch % 2 == 0:
        # every replica calls it, the chief writes ckpt-1, ckpt-2, ... (save_counter)
        checkpoint.save(checkpoint_prefix)

    template = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}"
    # result() sums every replica's totals: a collective, so every replica calls it
    sg.print(template.format(epoch + 1, float(train_loss), float(train_accuracy.result()) * 100,
                             float(test_loss.result()), float(test_accuracy.result()) * 100))

    test_loss.reset_state()  # reset_states() in TF 2's Keras
    train_accuracy.reset_state()
    test_accuracy.reset_state()

# --- Restore the latest checkpoint and test ------------------------------------------------------------
eval_accuracy = sg.metrics.SparseCategoricalAccuracy(name="eval_accuracy")

new_model = create_model()
new_optimizer = sg.optimizers.Adam().build(new_model.parameters())

test_dataset = sg.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)


def eval_step(images, labels):
    with torch.no_grad():
        predictions = new_model(images)
    eval_accuracy(labels, predictions)


checkpoint = sg.Checkpoint(optimizer=new_optimizer, model=new_model)
checkpoint.restore(sg.train.latest_checkpoint(checkpoint_dir))

for images, labels in test_dataset:
    eval_step(images, labels)

sg.print("Accuracy after restoring the saved model without strategy: {}".format(float(eval_accuracy.result()) * 100))

# --- Alternate ways of iterating over a dataset: using iterators -------------------------------------
for _ in range(EPOCHS):
    total_loss = 0.0
    num_batches = 0
    train_iter = iter(train_dist_dataset)

    for _ in range(10):
        total_loss += distributed_train_step(next(train_iter))
        num_batches += 1
    average_train_loss = total_loss / num_batches

    template = "Epoch {}, Loss: {}, Accuracy: {}"
    sg.print(template.format(epoch + 1, float(average_train_loss), float(train_accuracy.result()) * 100))
    train_accuracy.reset_state()


# --- Iterating inside a tf.function --------------------------------------------------------------------
def distributed_train_epoch(dataset):
    total_loss = 0.0
    num_batches = 0
    for x in dataset:
        per_replica_losses = strategy.run(train_step, args=(x,))
        total_loss += strategy.reduce(sg.ReduceOp.SUM, per_replica_losses, axis=None)
        num_batches += 1
    return total_loss / num_batches


for epoch in range(EPOCHS):
    train_loss = distributed_train_epoch(train_dist_dataset)

    template = "Epoch {}, Loss: {}, Accuracy: {}"
    sg.print(template.format(epoch + 1, float(train_loss), float(train_accuracy.result()) * 100))

    train_accuracy.reset_state()
