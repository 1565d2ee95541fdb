"""TensorFlow's tutorial "Save and load a model using a distribution strategy", in stratagem.

https://www.tensorflow.org/tutorials/distribute/save_and_load (tensorflow/docs
site/en/tutorials/distribute/save_and_load.ipynb), cell by cell: a model made and fitted under
``MirroredStrategy``, ``model.save`` / ``load_model`` (outside a scope, then in another strategy's
scope), training continued on the loaded models, then ``saved_model.save`` / ``load`` and the
``serving_default`` signature called on a batch, plainly and under ``strategy.run``, and the
``SaveOptions`` / ``LoadOptions`` of ``experimental_io_device``.
``python examples/tutorials/save_and_load_distributed.py`` (``NUM_REPLICAS=1`` runs one device;
``BATCH_SIZE_PER_REPLICA`` sets the tutorial's 64).

What differs: MNIST (tfds) is scikit-learn's digits (1x8x8, pixels / 16); Keras layers are torch
layers, channels-first; the seeds are set and the shuffle seeded so the test can compare the
1-replica and 2-replica runs; ``load_model`` of a model of torch layers takes ``model=`` (its
architecture); ``OneDeviceStrategy('/cpu:0')`` is written ``OneDeviceStrategy('cpu')``; the
``hub.KerasLayer`` cells (TensorFlow Hub) are not ported; paths are in the current directory.
"""

import os

import torch
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg

print = sg.print

NUM_REPLICAS = int(os.environ.get("NUM_REPLICAS", "2"))
strategy = sg.MirroredStrategy("cpu", num_replicas=NUM_REPLICAS) if NUM_REPLICAS > 1 else sg.get_strategy()
print(f"replicas: {[strategy.num_replicas_in_sync]}")


def show(tag, value):
    print(f"{tag}: {value!r}")


digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.uint8).unsqueeze(1)
labels = torch.tensor(digits.target, dtype=torch.int64)
mnist_train = sg.data.Dataset.from_tensor_slices((images[:1437], labels[:1437]))
mnist_test = sg.data.Dataset.from_tensor_slices((images[1437:], labels[1437:]))


def get_data():
    BUFFER_SIZE = 10000

    BATCH_SIZE_PER_REPLICA = int(os.environ.get("BATCH_SIZE_PER_REPLICA", "64"))
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

    def scale(image, label):
        image = image.to(torch.float32)
        image /= 16  # 255 for MNIST

        return image, label

    train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE, seed=0).batch(BATCH_SIZE)
    eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

    return train_dataset, eval_dataset


def get_model():
    torch.manual_seed(0)
    with strategy.scope():
        model = sg.Sequential(
            nn.Conv2d(1, 32, 3), nn.ReLU(),  # Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1))
            nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(288, 64), nn.ReLU(),
            nn.Linear(64, 10),
        )
        model.build((None, 1, 8, 8))  # Keras's input_shape=(28, 28, 1): torch layers have none

        model.compile(loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=sg.optimizers.Adam(),
                      metrics=[sg.metrics.SparseCategoricalAccuracy()])
        return model


def architecture():
    return sg.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(288, 64), nn.ReLU(), nn.Linear(64, 10))


def history_of(h):
    return {k: [float(v) for v in vs] for k, vs in h.history.items()}


model = get_model()
train_dataset, eval_dataset = get_data()
show("fit", history_of(model.fit(train_dataset, epochs=2, verbose=0)))

# ## The Keras API
keras_model_path = "keras_save.keras"
model.save(keras_model_path)

restored_keras_model = sg.load_model(keras_model_path, model=architecture())
show("fit restored", history_of(restored_keras_model.fit(train_dataset, epochs=2, verbose=0)))

another_strategy = sg.OneDeviceStrategy("cpu")  # tf.distribute.OneDeviceStrategy('/cpu:0')
with another_strategy.scope():
    restored_keras_model_ds = sg.load_model(keras_model_path, model=architecture())
    show("fit restored in OneDeviceStrategy",
         history_of(restored_keras_model_ds.fit(train_dataset, epochs=2, verbose=0)))

# ## The tf.saved_model API
model = get_model()
saved_model_path = "tf_save"
sg.saved_model.save(model, saved_model_path)

DEFAULT_FUNCTION_KEY = "serving_default"
loaded = sg.saved_model.load(saved_model_path)
inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]

predict_dataset = eval_dataset.map(lambda image, label: image)
for batch in predict_dataset.take(1):
    result = inference_func(batch)
    print(result)
    out = result if isinstance(result, torch.Tensor) else next(iter(result.values()))
    show("served", out[:2].detach().tolist())
    show("predict", model.predict(batch[:2], verbose=0).tolist())

another_strategy = strategy  # tf.distribute.MirroredStrategy(): one strategy per process here
with another_strategy.scope():
    loaded = sg.saved_model.load(saved_model_path)
    inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]

    dist_predict_dataset = another_strategy.experimental_distribute_dataset(predict_dataset)

    # Calling the function in a distributed manner
    for batch in dist_predict_dataset:
        result = another_strategy.run(inference_func, args=(batch,))
        print(result)
        break

# ## Saving/Loading from a local device
model = get_model()

# Saving the model using Keras `model.save`
save_options = sg.saved_model.SaveOptions(experimental_io_device="/job:localhost")
model.save(keras_model_path, options=save_options)

# Loading the model using Keras load_model
with another_strategy.scope():
    load_options = sg.saved_model.LoadOptions(experimental_io_device="/job:localhost")
    loaded = sg.load_model(keras_model_path, options=load_options, model=architecture())
show("loaded with options", loaded.predict(batch if isinstance(batch, torch.Tensor) else images[1437:1439].float() / 16,
                                           verbose=0)[:2].tolist())
