"""TensorFlow's tutorial "Distributed training with Keras", in stratagem.

https://www.tensorflow.org/tutorials/distribute/keras, cell by cell, with its names and in its
order: a MirroredStrategy, the model built and compiled in ``strategy.scope()``, ``fit`` with the
tutorial's callbacks, the latest checkpoint restored and evaluated, then ``model.save`` and
``load_model`` outside and inside the scope. What differs, and why:

- MNIST (downloaded by tfds) is scikit-learn's digits (8x8 images, 10 classes, shipped with the
  package): 1437 training and 360 test images, pixel values 0..16, so ``scale`` divides by 16.
- ``tf.distribute.MirroredStrategy()`` takes every GPU; on a machine without GPUs it is one CPU
  replica, so the port asks for two CPU replicas (the script starts the second itself).
- Keras layers are torch layers (``Conv2D(32, 3, activation='relu')`` is ``nn.Conv2d(1, 32, 3),
  nn.ReLU()``); images are channels-first.
- The seeds are set (``tf.keras.utils.set_random_seed(0)`` in TF) so the test can compare every
  number with Keras 3 itself, step for step.
- ``%tensorboard --logdir=logs`` is a notebook magic: from a shell, ``tensorboard --logdir=logs``
  shows what the ``TensorBoard`` callback wrote (it needs the ``tensorboard`` package).
- ``load_model`` is given the architecture (torch has no portable form of it): ``model=``.
- What tf's one process prints once, the chief prints (``sg.print``).

Run: ``python examples/tutorials/keras_distributed.py`` (writes ./training_checkpoints, ./logs and
./my_model.keras in the current directory, as the tutorial does).
"""

# Import TensorFlow and TensorFlow Datasets

import os

import torch
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg

print = sg.print  # tf's one process prints once: here the chief does

print(torch.__version__)
torch.manual_seed(0)  # tf.keras.utils.set_random_seed(0)

# ## Download the dataset (tfds.load(name='mnist', with_info=True, as_supervised=True))

digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.uint8).unsqueeze(1)  # [N, 1, 8, 8], 0..16
labels = torch.tensor(digits.target, dtype=torch.int64)
mnist_train = sg.data.Dataset.from_tensor_slices((images[:1437], labels[:1437]))
mnist_test = sg.data.Dataset.from_tensor_slices((images[1437:], labels[1437:]))

# ## Define the distribution strategy

strategy = sg.MirroredStrategy("cpu", num_replicas=2)

print("Number of devices: {}".format(strategy.num_replicas_in_sync))  # noqa: UP032

# ## Set up the input pipeline

# You can also do info.splits.total_num_examples to get the total
# number of examples in the dataset.

num_train_examples = 1437  # info.splits['train'].num_examples
num_test_examples = 360  # info.splits['test'].num_examples

BUFFER_SIZE = 10000

BATCH_SIZE_PER_REPLICA = 64
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync


def scale(image, label):
    image = image.to(torch.float32)  # tf.cast(image, tf.float32)
    image /= 16  # the digits' pixels are 0..16 (MNIST's 0..255)

    return image, label


train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE, seed=0).batch(BATCH_SIZE)
eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

# ## Create the model and instantiate the optimizer


def build_model():  # the tutorial's tf.keras.Sequential([...]), written once for the three models
    return sg.Sequential([
        nn.Conv2d(1, 32, 3), nn.ReLU(),  # Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1))
        nn.MaxPool2d(2),  # MaxPooling2D()
        nn.Flatten(),
        nn.Linear(32 * 3 * 3, 64), nn.ReLU(),  # Dense(64, activation='relu')
        nn.Linear(64, 10),  # Dense(10)
    ])  # fmt: skip


with strategy.scope():
    model = build_model()

    model.compile(loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=sg.optimizers.Adam(learning_rate=0.001),
                  metrics=['accuracy'])  # fmt: skip

# ## Define the callbacks

# Define the checkpoint directory to store the checkpoints.
checkpoint_dir = './training_checkpoints'
# Define the name of the checkpoint files.
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch:04d}.weights.h5")


# Define a function for decaying the learning rate.
# You can define any decay function you need.
def decay(epoch):
    if epoch < 3:
        return 1e-3
    elif epoch >= 3 and epoch < 7:
        return 1e-4
    else:
        return 1e-5


# Define a callback for printing the learning rate at the end of each epoch.
class PrintLR(sg.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print('\nLearning rate for epoch {} is {}'.format(epoch + 1, model.optimizer.learning_rate))  # noqa: UP032


# Put all the callbacks together.
callbacks = [
    sg.callbacks.TensorBoard(log_dir='./logs'),
    sg.callbacks.ModelCheckpoint(filepath=checkpoint_prefix,
                                 save_weights_only=True),
    sg.callbacks.LearningRateScheduler(decay),
    PrintLR()
]  # fmt: skip

# ## Train and evaluate

EPOCHS = 12

model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks)

# Check the checkpoint directory.
print(sorted(os.listdir(checkpoint_dir)))  # !ls {checkpoint_dir}

import pathlib  # noqa: E402 (where the tutorial imports it)

latest_checkpoint = sorted(pathlib.Path(checkpoint_dir).glob('*'))[-1]
model.load_weights(latest_checkpoint)
eval_loss, eval_acc = model.evaluate(eval_dataset)
print('Eval loss: {}, Eval accuracy: {}'.format(eval_loss, eval_acc))  # noqa: UP032

print(sorted(os.listdir('./logs')))  # !ls -sh ./logs

# ## Save the model

path = 'my_model.keras'

model.save(path)

unreplicated_model = sg.load_model(path, model=build_model())  # tf.keras.models.load_model(path)

unreplicated_model.compile(
    loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
    optimizer=sg.optimizers.Adam(),
    metrics=['accuracy'])  # fmt: skip

eval_loss, eval_acc = unreplicated_model.evaluate(eval_dataset)

print('Eval loss: {}, Eval Accuracy: {}'.format(eval_loss, eval_acc))  # noqa: UP032

with strategy.scope():
    replicated_model = sg.load_model(path, model=build_model())
    replicated_model.compile(loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                             optimizer=sg.optimizers.Adam(),
                             metrics=['accuracy'])  # fmt: skip

    eval_loss, eval_acc = replicated_model.evaluate(eval_dataset)
    print('Eval loss: {}, Eval Accuracy: {}'.format(eval_loss, eval_acc))  # noqa: UP032
