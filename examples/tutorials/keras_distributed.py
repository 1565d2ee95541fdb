"""TensorFlow's tutorial "Distributed training with Keras", in stratagem.

The same steps: a MirroredStrategy, the model and optimizer created in ``strategy.scope()``,
``fit`` with callbacks (a learning-rate decay schedule, a callback printing the rate, a CSV log
in place of TensorBoard), restoring the latest checkpoint and ``evaluate``. MNIST is replaced by
small images made here (the label is the brightest quadrant). Run:
``python examples/tutorials/keras_distributed.py`` (starts its second replica itself).
"""

import os

import torch
from torch import nn

import stratagem as sg

strategy = sg.MirroredStrategy("cpu", num_replicas=2)
chief = strategy.extended.should_log
print(f"Number of devices: {strategy.num_replicas_in_sync}") if chief else None


def make_images(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=g)
    images = torch.rand(n, 1, 12, 12, generator=g) * 0.5
    for i, label in enumerate(labels.tolist()):
        r, c = divmod(label, 2)
        images[i, 0, r * 6 : r * 6 + 6, c * 6 : c * 6 + 6] += 0.5
    return images, labels


BUFFER_SIZE = 512
BATCH_SIZE_PER_REPLICA = 32
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

train_dataset = sg.data.Dataset.from_tensor_slices(make_images(512, seed=0)).shuffle(BUFFER_SIZE, seed=0).batch(BATCH_SIZE)
eval_dataset = sg.data.Dataset.from_tensor_slices(make_images(128, seed=1)).batch(BATCH_SIZE)

with strategy.scope():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, 4),
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
loss = nn.CrossEntropyLoss()  # from_logits=True; fit reads the per-example losses
metrics = [sg.metrics.SparseCategoricalAccuracy(name="accuracy")]

checkpoint_dir = os.environ.get("CHECKPOINT_DIR", "./training_checkpoints")
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}")


def decay(epoch):  # the tutorial's learning-rate schedule
    if epoch < 3:
        return 1e-3
    elif epoch >= 3 and epoch < 7:
        return 1e-4
    else:
        return 1e-5


class PrintLR(sg.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if self.is_chief:
            print(f"\nLearning rate for epoch {epoch + 1} is {self.optimizer.param_groups[0]['lr']}")


callbacks = [
    sg.callbacks.CSVLogger(os.path.join(checkpoint_dir, "training.csv")),  # the tutorial's TensorBoard
    sg.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
    sg.callbacks.LearningRateScheduler(decay),
    PrintLR(),
]

EPOCHS = 4
sg.fit(model, optimizer, loss, train_dataset, epochs=EPOCHS, metrics=metrics, callbacks=callbacks, verbose=0)

sg.train.load_weights(model, sg.train.latest_checkpoint(checkpoint_dir))  # model.load_weights(tf.train.latest_checkpoint(...))
eval_loss, eval_acc = sg.evaluate(model, loss, eval_dataset, metrics=[sg.metrics.SparseCategoricalAccuracy(name="accuracy")])
if chief:
    print(f"Eval loss: {eval_loss:.4f}, Eval accuracy: {eval_acc:.4f}")
