"""TensorFlow's tutorial "Custom training loop with Keras and MultiWorkerMirroredStrategy", in stratagem.

https://www.tensorflow.org/tutorials/distribute/multi_worker_with_ctl, cell by cell, with its
names and in its order. The notebook's cells and its two files (``mnist.py``, ``main.py``) are
one script here:

- run without TF_CONFIG, it is the notebook: it starts the two workers, each with its TF_CONFIG
  (the tutorial's ``%%bash --bg python main.py`` cells), waits for them and shows their logs;
- run with TF_CONFIG, it is ``main.py``: ``MultiWorkerMirroredStrategy()`` reads TF_CONFIG, the
  model, the per-worker datasets (``distribute_datasets_from_function``, sharded by
  ``input_context``), the optimizer and the metric are made in its scope, a training step runs
  ``strategy.run`` on the next batch and sums the replicas' losses, and the epoch and step
  counters are checkpointed with the model (``write_filepath`` for the other workers, then
  ``rmtree``). Run again, it goes on from the newest checkpoint, as in TensorFlow.

What differs, and why: MNIST (downloaded) is scikit-learn's digits (8x8, pixels 0..16, 1797
images), so an epoch is ``num_steps_per_epoch = 7`` steps of 64 per worker (70 in the tutorial,
which has 30,000 images per worker); the shuffle and the initial weights are seeded (``seed=0``,
``torch.manual_seed(0)``) so the test can compare the numbers with a reference; Keras layers are
torch layers; ``tf.Variable`` counters are tensors, restored in place; ``CUDA_VISIBLE_DEVICES=-1``
is ``devices="cpu"``; ``util.get_temp_dir()`` (a fresh directory per process) is ``./ckpt``, so
that a second run finds the first run's checkpoint, as the tutorial's restore means it to.
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

# ### Dataset and model definition (the tutorial's mnist.py)


def mnist_dataset(batch_size):
    digits = load_digits()  # (x_train, y_train), _ = tf.keras.datasets.mnist.load_data()
    x_train, y_train = digits.images.astype(np.uint8), digits.target
    # The `x` arrays are in uint8 and have values in the range [0, 16].
    # You need to convert them to float32 with values in the range [0, 1]
    x_train = x_train / np.float32(16)
    y_train = y_train.astype(np.int64)
    train_dataset = sg.data.Dataset.from_tensor_slices(
        (x_train, y_train)).shuffle(1797, seed=0)  # fmt: skip
    return train_dataset


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = mnist_dataset(batch_size)
    dataset = dataset.shard(input_context.num_input_pipelines,
                            input_context.input_pipeline_id)  # fmt: skip
    dataset = dataset.batch(batch_size)
    return dataset


def build_cnn_model():
    torch.manual_seed(0)  # tf.keras.utils.set_random_seed(0): the test rebuilds these weights
    return sg.Sequential([
        nn.Unflatten(1, (1, 8)),  # tf.keras.Input(shape=(28, 28)), Reshape(target_shape=(28, 28, 1))
        nn.Conv2d(1, 32, 3), nn.ReLU(),  # Conv2D(32, 3, activation='relu')
        nn.Flatten(),
        nn.Linear(32 * 6 * 6, 128), nn.ReLU(),  # Dense(128, activation='relu')
        nn.Linear(128, 10),  # Dense(10)
    ])  # fmt: skip


# ## The notebook: the workers started in the background


def notebook():
    os.environ.pop('TF_CONFIG', None)
    from stratagem.cluster import find_free_port

    tf_config = {
        'cluster': {
            'worker': [f'localhost:{find_free_port()}', f'localhost:{find_free_port()}']
        },
        'task': {'type': 'worker', 'index': 0}
    }  # fmt: skip
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


# ## main.py (run by every worker)


def main():
    per_worker_batch_size = 64
    tf_config = json.loads(os.environ['TF_CONFIG'])
    num_workers = len(tf_config['cluster']['worker'])
    global_batch_size = per_worker_batch_size * num_workers

    num_epochs = 3
    num_steps_per_epoch = 7  # 70 in the tutorial: 898 digits per worker make 14 batches of 64

    # Checkpoint saving and restoring
    def _is_chief(task_type, task_id, cluster_spec):
        return (task_type is None
                or task_type == 'chief'
                or (task_type == 'worker'
                    and task_id == 0
                    and 'chief' not in cluster_spec.as_dict()))  # fmt: skip

    def _get_temp_dir(dirpath, task_id):
        base_dirpath = 'workertemp_' + str(task_id)
        temp_dir = os.path.join(dirpath, base_dirpath)
        os.makedirs(temp_dir, exist_ok=True)  # tf.io.gfile.makedirs(temp_dir)
        return temp_dir

    def write_filepath(filepath, task_type, task_id, cluster_spec):
        dirpath = os.path.dirname(filepath)
        base = os.path.basename(filepath)
        if not _is_chief(task_type, task_id, cluster_spec):
            dirpath = _get_temp_dir(dirpath, task_id)
        return os.path.join(dirpath, base)

    checkpoint_dir = os.path.join('.', 'ckpt')  # os.path.join(util.get_temp_dir(), 'ckpt')

    # Define Strategy
    strategy = sg.MultiWorkerMirroredStrategy(devices="cpu")  # CUDA_VISIBLE_DEVICES=-1

    with strategy.scope():
        # Model building/compiling need to be within `strategy.scope()`.
        multi_worker_model = build_cnn_model()

        multi_worker_dataset = strategy.distribute_datasets_from_function(
            lambda input_context: dataset_fn(global_batch_size, input_context))  # fmt: skip
        optimizer = sg.optimizers.RMSprop(learning_rate=0.001).build(multi_worker_model.parameters())
        train_accuracy = sg.metrics.SparseCategoricalAccuracy(
            name='train_accuracy')  # fmt: skip

    @sg.function
    def train_step(iterator):
        """Training step function."""

        def step_fn(inputs):
            """Per-Replica step function."""
            x, y = inputs
            optimizer.zero_grad()  # tf.GradientTape: torch records the graph by itself
            predictions = multi_worker_model(x)  # training=True: the model is in train mode
            per_batch_loss = sg.losses.SparseCategoricalCrossentropy(
                from_logits=True,
                reduction=sg.losses.Reduction.NONE)(y, predictions)  # fmt: skip
            loss = sg.compute_average_loss(
                per_batch_loss, global_batch_size=global_batch_size)  # fmt: skip

            loss.backward()  # tape.gradient; the gradients are summed across replicas
            optimizer.step()  # optimizer.apply_gradients
            train_accuracy.update_state(y, predictions.detach())

            return loss.detach()

        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(
            sg.ReduceOp.SUM, per_replica_losses, axis=None)  # fmt: skip

    epoch = torch.tensor(0, dtype=torch.int64)  # tf.Variable(initial_value=tf.constant(0, dtype=tf.dtypes.int64), name='epoch')
    step_in_epoch = torch.tensor(0, dtype=torch.int64)  # tf.Variable(..., name='step_in_epoch')

    task_type, task_id, cluster_spec = (strategy.cluster_resolver.task_type,
                                        strategy.cluster_resolver.task_id,
                                        strategy.cluster_resolver.cluster_spec())  # fmt: skip

    checkpoint = sg.Checkpoint(
        model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)  # fmt: skip

    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id,
                                          cluster_spec)  # fmt: skip
    checkpoint_manager = sg.CheckpointManager(
        checkpoint, directory=write_checkpoint_dir, max_to_keep=1)  # fmt: skip

    # Restoring the checkpoint
    latest_checkpoint = sg.train.latest_checkpoint(checkpoint_dir)
    if latest_checkpoint:
        checkpoint.restore(latest_checkpoint)

    # Resume our CTL training
    while epoch.numpy() < num_epochs:
        iterator = iter(multi_worker_dataset)
        total_loss = 0.0
        num_batches = 0

        while step_in_epoch.numpy() < num_steps_per_epoch:
            total_loss += train_step(iterator)
            num_batches += 1
            step_in_epoch += 1  # step_in_epoch.assign_add(1)

        train_loss = total_loss / num_batches
        print('Epoch: %d, accuracy: %f, train_loss: %f.'
              % (epoch.numpy(), train_accuracy.result(), train_loss))  # fmt: skip

        train_accuracy.reset_state()  # reset_states() in TF 2's Keras

        checkpoint_manager.save()
        if not _is_chief(task_type, task_id, cluster_spec):
            shutil.rmtree(write_checkpoint_dir)  # tf.io.gfile.rmtree

        epoch += 1  # epoch.assign_add(1)
        step_in_epoch.zero_()  # step_in_epoch.assign(0)


if __name__ == "__main__":
    main() if "TF_CONFIG" in os.environ else notebook()
