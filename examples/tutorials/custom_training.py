"""TensorFlow's tutorial "Custom training with tf.distribute.Strategy", in stratagem.

Same steps, same names: a MirroredStrategy, global batches split across replicas, a custom
training loop with ``strategy.run`` and ``strategy.reduce``, ``compute_average_loss`` for the
loss, metrics summed across replicas, a checkpoint. Fashion-MNIST is replaced by small images
made here (a label is the brightest quadrant), so it runs anywhere in seconds:
``python examples/tutorials/custom_training.py`` (starts its second replica itself).
"""

import os

import torch
from torch import nn

import stratagem as sg

strategy = sg.MirroredStrategy("cpu", num_replicas=2)
print(f"Number of devices: {strategy.num_replicas_in_sync}") if strategy.extended.should_log else None


# --- set up the input pipeline ------------------------------------------------------------------
def make_images(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=g)
    images = torch.rand(n, 1, 12, 12, generator=g) * 0.5
    for i, label in enumerate(labels.tolist()):
        r, c = divmod(label, 2)
        images[i, 0, r * 6 : r * 6 + 6, c * 6 : c * 6 + 6] += 0.5
    return images, labels


train_images, train_labels = make_images(512, seed=0)
test_images, test_labels = make_images(128, seed=1)

BUFFER_SIZE = len(train_images)
BATCH_SIZE_PER_REPLICA = 32
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
EPOCHS = 4

train_dataset = sg.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(BUFFER_SIZE, seed=0).batch(GLOBAL_BATCH_SIZE)
test_dataset = sg.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)


# --- create the model ---------------------------------------------------------------------------
def create_model():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4),
    )  # fmt: skip


checkpoint_dir = os.environ.get("CHECKPOINT_DIR", "./training_checkpoints")

# --- define the loss function, the metrics, the model and the optimizer (in the scope) -----------
with strategy.scope():
    loss_object = nn.CrossEntropyLoss(reduction="none")  # per-example losses, as Reduction.NONE

    def compute_loss(labels, predictions):
        per_example_loss = loss_object(predictions, labels)
        return sg.compute_average_loss(per_example_loss)  # sum / global batch size

    test_loss = sg.metrics.Mean(name="test_loss")
    train_accuracy = sg.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    test_accuracy = sg.metrics.SparseCategoricalAccuracy(name="test_accuracy")

    torch.manual_seed(0)
    model = create_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    checkpoint = sg.Checkpoint(model=model, optimizer=optimizer)
    manager = sg.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=2)


# --- the training loop ----------------------------------------------------------------------------
def train_step(inputs):
    images, labels = inputs
    optimizer.zero_grad()
    predictions = model(images)
    loss = compute_loss(labels, predictions)
    loss.backward()
    optimizer.step()
    train_accuracy.update_state(labels, predictions.detach())
    return loss.detach()


def test_step(inputs):
    images, labels = inputs
    with torch.no_grad():
        predictions = model(images)
        t_loss = loss_object(predictions, labels)
    test_loss.update_state(t_loss)
    test_accuracy.update_state(labels, predictions)


def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(sg.ReduceOp.SUM, per_replica_losses, axis=None)


def distributed_test_step(dataset_inputs):
    return strategy.run(test_step, args=(dataset_inputs,))


for epoch in range(EPOCHS):
    total_loss = 0.0
    num_batches = 0
    for x in train_dist_dataset:
        total_loss += float(distributed_train_step(x))
        num_batches += 1
    train_loss = total_loss / num_batches

    for x in test_dist_dataset:
        distributed_test_step(x)

    if epoch % 2 == 0:
        manager.save(epoch)  # every replica calls it; the chief writes

    # result() sums every replica's totals: every replica calls it
    results = (float(test_loss.result()), float(train_accuracy.result()), float(test_accuracy.result()))
    if strategy.extended.should_log:
        print(
            f"Epoch {epoch + 1}, Loss: {train_loss:.4f}, Accuracy: {results[1] * 100:.2f}, "
            f"Test Loss: {results[0]:.4f}, Test Accuracy: {results[2] * 100:.2f}"
        )

    test_loss.reset_state()
    train_accuracy.reset_state()
    test_accuracy.reset_state()
