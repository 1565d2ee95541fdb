"""TensorFlow's tutorial "Multi-worker training with Keras" (TF_CONFIG), in stratagem.

https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras, cell by cell, with its
names and in its order. The notebook's cells and its two files are one script here:

- run without TF_CONFIG, it is the notebook: it trains the model on a single worker, then starts
  the two workers in the background, each with its TF_CONFIG (the tutorial's ``%%bash --bg python
  main.py`` cells), and waits for them;
- run with TF_CONFIG, it is ``main.py``: ``MultiWorkerMirroredStrategy()`` reads TF_CONFIG, the
  model is built and compiled in its scope, ``fit`` trains one model on a global batch of
  ``per_worker_batch_size * num_workers``; then the tutorial's "in depth" cells: the save logic
  with ``write_filepath`` / ``_is_chief``, ``load_model``, a checkpoint kept by a
  ``CheckpointManager`` and restored, and ``BackupAndRestore``.

Run the workers yourself (one shell each, as in the tutorial)::

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 0}}' python multi_worker_tf_config.py
    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 1}}' python multi_worker_tf_config.py

What differs, and why: MNIST (downloaded) is scikit-learn's digits (8x8, pixels 0..16); Keras
layers are torch layers; the shuffle and the initial weights are seeded (``seed=0``,
``torch.manual_seed(0)``; tf.keras.utils.set_random_seed in TF) so the test can compare the
numbers with a reference; ``CUDA_VISIBLE_DEVICES=-1`` becomes ``devices="cpu"``; ``/tmp/...`` paths
are relative (``./keras-model``, ``./ckpt``, ``./backup``) so runs do not share them;
``load_model`` is given the architecture; what tf's chief worker prints is printed by the chief
(``sg.print``).
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg

print = sg.print  # printed once, by the chief

# ### Dataset and model definition (the tutorial's mnist_setup.py)


def mnist_dataset(batch_size):
    digits = load_digits()  # tf.keras.datasets.mnist.load_data()
    x_train, y_train = digits.images.astype(np.uint8), digits.target  # uint8, as MNIST's
    # The `x` arrays are in uint8 and have values in the [0, 16] range.
    # You need to convert them to float32 with values in the [0, 1] range.
    x_train = x_train / np.float32(16)
    y_train = y_train.astype(np.int64)
    train_dataset = sg.data.Dataset.from_tensor_slices(
        (x_train, y_train)).shuffle(1797, seed=0).repeat().batch(batch_size)  # fmt: skip
    return train_dataset


def build_cnn_model():
    torch.manual_seed(0)  # tf.keras.utils.set_random_seed(0): the test rebuilds these weights
    return sg.Sequential([
        nn.Unflatten(1, (1, 8)),  # [N, 8, 8] -> [N, 1, 8, 8]: InputLayer(input_shape=(28, 28)), Reshape(target_shape=(28, 28, 1))
        nn.Conv2d(1, 32, 3), nn.ReLU(),  # Conv2D(32, 3, activation='relu')
        nn.Flatten(),
        nn.Linear(32 * 6 * 6, 128), nn.ReLU(),  # Dense(128, activation='relu')
        nn.Linear(128, 10),  # Dense(10)
    ])  # fmt: skip


def build_and_compile_cnn_model():
    model = build_cnn_model()
    model.compile(
        loss=sg.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=sg.optimizers.SGD(learning_rate=0.001),
        metrics=['accuracy'])  # fmt: skip
    return model


# ## The notebook: a single worker, then the workers started in the background


def notebook():
    os.environ.pop('TF_CONFIG', None)

    # ### Model training on a single worker
    batch_size = 64
    single_worker_dataset = mnist_dataset(batch_size)
    single_worker_model = build_and_compile_cnn_model()
    single_worker_model.fit(single_worker_dataset, epochs=3, steps_per_epoch=70)

    # ### A cluster with jobs and tasks
    from stratagem.cluster import find_free_port

    tf_config = {
        'cluster': {
            'worker': [f'localhost:{find_free_port()}', f'localhost:{find_free_port()}']
        },
        'task': {'type': 'worker', 'index': 0}
    }  # fmt: skip
    print(json.dumps(tf_config))

    # %%bash --bg python main.py &> job_0.log, then the second worker with index 1
    os.environ['TF_CONFIG'] = json.dumps(tf_config)
    job_0 = subprocess.Popen([sys.executable, __file__], stdout=open('job_0.log', 'w'), stderr=subprocess.STDOUT)
    tf_config['task']['index'] = 1
    os.environ['TF_CONFIG'] = json.dumps(tf_config)
    code = subprocess.call([sys.executable, __file__])
    code = max(code, job_0.wait())
    os.environ.pop('TF_CONFIG', None)
    with open('job_0.log') as log:  # %%bash cat job_0.log
        sys.stdout.write(log.read())
    sys.exit(code)


# ## Train the model (the tutorial's main.py, run by every worker)


def main():
    per_worker_batch_size = 64
    tf_config = json.loads(os.environ['TF_CONFIG'])
    num_workers = len(tf_config['cluster']['worker'])

    strategy = sg.MultiWorkerMirroredStrategy(devices="cpu")  # CUDA_VISIBLE_DEVICES=-1

    global_batch_size = per_worker_batch_size * num_workers
    multi_worker_dataset = mnist_dataset(global_batch_size)

    with strategy.scope():
        # Model building/compiling need to be within `strategy.scope()`.
        multi_worker_model = build_and_compile_cnn_model()

    multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=70)

    # ### Dataset sharding
    options = sg.data.Options()
    options.experimental_distribute.auto_shard_policy = sg.data.AutoShardPolicy.OFF

    global_batch_size = 64
    multi_worker_dataset = mnist_dataset(batch_size=64)
    dataset_no_auto_shard = multi_worker_dataset.with_options(options)  # noqa: F841 (as in the tutorial)

    # ### Model saving and loading
    model_path = './keras-model'  # '/tmp/keras-model'

    def _is_chief(task_type, task_id):
        # Note: there are two possible `TF_CONFIG` configurations.
        #   1) In addition to `worker` tasks, a `chief` task type is use;
        #      in this case, this function should be modified to
        #      `return task_type == 'chief'`.
        #   2) Only `worker` task type is used; in this case, worker 0 is
        #      regarded as the chief. The implementation demonstrated here
        #      is for this case.
        # For the purpose of this Colab section, the `task_type` is `None` case
        # is added because it is effectively run with only a single worker.
        return (task_type == 'worker' and task_id == 0) or task_type is None

    def _get_temp_dir(dirpath, task_id):
        base_dirpath = 'workertemp_' + str(task_id)
        temp_dir = os.path.join(dirpath, base_dirpath)
        os.makedirs(temp_dir, exist_ok=True)  # tf.io.gfile.makedirs(temp_dir)
        return temp_dir

    def write_filepath(filepath, task_type, task_id):
        dirpath = os.path.dirname(filepath)
        base = os.path.basename(filepath)
        if not _is_chief(task_type, task_id):
            dirpath = _get_temp_dir(dirpath, task_id)
        return os.path.join(dirpath, base)

    task_type, task_id = (strategy.cluster_resolver.task_type,
                          strategy.cluster_resolver.task_id)  # fmt: skip
    write_model_path = write_filepath(model_path, task_type, task_id)

    multi_worker_model.save(write_model_path)

    if not _is_chief(task_type, task_id):
        shutil.rmtree(os.path.dirname(write_model_path))  # tf.io.gfile.rmtree

    loaded_model = sg.load_model(model_path, model=build_cnn_model())  # tf.keras.models.load_model(model_path)

    # Now that the model is restored, and can continue with the training.
    single_worker_dataset = mnist_dataset(64)
    loaded_model.fit(single_worker_dataset, epochs=2, steps_per_epoch=20)

    # ### Checkpoint saving and restoring
    checkpoint_dir = './ckpt'  # '/tmp/ckpt'

    checkpoint = sg.Checkpoint(model=multi_worker_model)
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
    checkpoint_manager = sg.CheckpointManager(
        checkpoint, directory=write_checkpoint_dir, max_to_keep=1)  # fmt: skip

    checkpoint_manager.save()
    if not _is_chief(task_type, task_id):
        shutil.rmtree(write_checkpoint_dir)  # tf.io.gfile.rmtree (the chief wrote the checkpoint)

    latest_checkpoint = sg.train.latest_checkpoint(checkpoint_dir)
    checkpoint.restore(latest_checkpoint)
    multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=20)

    # #### The `BackupAndRestore` callback

    # Multi-worker training with `MultiWorkerMirroredStrategy`
    # and the `BackupAndRestore` callback. The training state
    # is backed up at epoch boundaries by default.
    callbacks = [sg.callbacks.BackupAndRestore(backup_dir='./backup')]
    with strategy.scope():
        multi_worker_model = build_and_compile_cnn_model()
    multi_worker_model.fit(multi_worker_dataset,
                           epochs=3,
                           steps_per_epoch=70,
                           callbacks=callbacks)  # fmt: skip

    # The training state is backed up at epoch boundaries because `save_freq` is
    # set to `epoch`.
    callbacks = [sg.callbacks.BackupAndRestore(backup_dir='./backup')]
    with strategy.scope():
        multi_worker_model = build_and_compile_cnn_model()
    multi_worker_model.fit(multi_worker_dataset,
                           epochs=3,
                           steps_per_epoch=70,
                           callbacks=callbacks)  # fmt: skip

    # The training state is backed up at every 30 steps because `save_freq` is set
    # to an integer value of `30`.
    callbacks = [sg.callbacks.BackupAndRestore(backup_dir='./backup', save_freq=30)]
    with strategy.scope():
        multi_worker_model = build_and_compile_cnn_model()
    multi_worker_model.fit(multi_worker_dataset,
                           epochs=3,
                           steps_per_epoch=70,
                           callbacks=callbacks)  # fmt: skip
    print("backup_dir after fit:", sorted(os.listdir('./backup')) if os.path.exists('./backup') else None)


if __name__ == "__main__":
    main() if "TF_CONFIG" in os.environ else notebook()
