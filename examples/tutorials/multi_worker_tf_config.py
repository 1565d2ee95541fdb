"""TensorFlow's tutorial "Multi-worker training with Keras" (TF_CONFIG), in stratagem.

Each worker is a process started with its own TF_CONFIG (the cluster's workers and this task's
index), exactly as in the tutorial; ``MultiWorkerMirroredStrategy()`` reads it through its
cluster resolver, meets the other workers, and ``fit`` trains one model on a global batch of
``per_worker_batch_size * num_workers``. MNIST is replaced by small images made here.

Run the workers yourself (one shell each, as in the tutorial)::

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 0}}' python multi_worker_tf_config.py
    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 1}}' python multi_worker_tf_config.py

or run it without TF_CONFIG and it starts two workers on this machine, each with its TF_CONFIG.
"""

import json
import os
import subprocess
import sys

import torch
from torch import nn

import stratagem as sg


def mnist_dataset(batch_size):  # the tutorial's mnist_setup.mnist_dataset, with made-up images
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (1024,), generator=g)
    images = torch.rand(1024, 1, 12, 12, generator=g) * 0.5
    for i, label in enumerate(labels.tolist()):
        r, c = divmod(label, 2)
        images[i, 0, r * 6 : r * 6 + 6, c * 6 : c * 6 + 6] += 0.5
    return sg.data.Dataset.from_tensor_slices((images, labels)).shuffle(1024, seed=0).repeat().batch(batch_size)


def build_cnn_model():  # mnist_setup.build_and_compile_cnn_model
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(),
        nn.Linear(32 * 10 * 10, 64), nn.ReLU(), nn.Linear(64, 4),
    )  # fmt: skip


def main():
    per_worker_batch_size = 32
    tf_config = json.loads(os.environ["TF_CONFIG"])
    num_workers = len(tf_config["cluster"]["worker"])

    strategy = sg.MultiWorkerMirroredStrategy(devices="cpu")

    global_batch_size = per_worker_batch_size * num_workers
    multi_worker_dataset = mnist_dataset(global_batch_size)

    with strategy.scope():
        torch.manual_seed(0)
        multi_worker_model = build_cnn_model()
        optimizer = torch.optim.SGD(multi_worker_model.parameters(), lr=0.05)

    history = sg.fit(
        multi_worker_model, optimizer, nn.CrossEntropyLoss(), multi_worker_dataset,
        epochs=3, steps_per_epoch=20, metrics=[sg.metrics.SparseCategoricalAccuracy(name="accuracy")],
        verbose=0,
    )  # fmt: skip
    if strategy.extended.should_log:
        print(f"workers={strategy.num_replicas_in_sync} accuracy={history.history['accuracy'][-1]:.4f}")


def start_workers(n=2):
    """The tutorial's shell cells: start each worker in the background with its TF_CONFIG."""
    from stratagem.cluster import find_free_port

    workers = [f"localhost:{find_free_port()}" for _ in range(n)]
    procs = []
    for index in range(n):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = {**os.environ, "TF_CONFIG": json.dumps(tf_config)}
        procs.append(subprocess.Popen([sys.executable, __file__], env=env))
    codes = [p.wait() for p in procs]
    sys.exit(max(codes))


if __name__ == "__main__":
    main() if "TF_CONFIG" in os.environ else start_workers()
