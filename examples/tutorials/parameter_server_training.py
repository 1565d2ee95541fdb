"""TensorFlow's tutorial "Parameter server training with ParameterServerStrategy", in stratagem.

Same steps, same names: a cluster of a chief (the coordinator), workers and ps tasks; a
``ParameterServerStrategy`` whose ``variable_partitioner`` splits the embedding table over
shards; training with ``fit`` (``steps_per_epoch`` is required, as in Keras); then a custom
training loop: ``ClusterCoordinator``, ``create_per_worker_dataset``, ``schedule``, ``join``,
``fetch``, an accuracy metric; and inline evaluation on the chief. The tutorial's data is made
here, so it runs anywhere in seconds.

Cluster setup: the tutorial starts an in-process cluster; here every task is a process running
this same script. On one machine (a chief, 2 workers and 1 ps task, each given its TF_CONFIG)::

    python -m stratagem run --workers 2 --ps 1 examples/tutorials/parameter_server_training.py

On many machines, start this script on each with TF_CONFIG naming the cluster and the task, as in
TensorFlow: ``{"cluster": {"chief": [...], "worker": [...], "ps": [...]}, "task": {"type":
"worker", "index": 0}}``. On worker and ps tasks the strategy's constructor serves the chief and
ends the process when the chief is done; everything after it runs on the chief only.
"""

import json
import os
import random

import torch
from torch import nn

import stratagem as sg

# --- cluster setup and instantiating a ParameterServerStrategy ----------------------------------
NUM_PS = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"])
# shards of at least 256 KiB, at most 2 (the tutorial has max_shards=NUM_PS; with 2 ps tasks,
# `--ps 2`, each shard lives on its own task)
variable_partitioner = sg.partitioners.MinSizePartitioner(min_shard_bytes=(256 << 10), max_shards=max(2, NUM_PS))

strategy = sg.ParameterServerStrategy(variable_partitioner=variable_partitioner)
# only the chief (the coordinator) gets here
torch.manual_seed(0)
random.seed(0)


# --- training with fit --------------------------------------------------------------------------
def dataset_fn(input_context):  # runs on each worker: its own copy of the data
    global_batch_size = 64
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    g = torch.Generator().manual_seed(input_context.input_pipeline_id)
    x = torch.rand(64, 10, generator=g)
    y = x.sum(1, keepdim=True)  # a task a Dense(1) can learn
    dataset = sg.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=0).repeat()
    return dataset.batch(batch_size)


with strategy.scope():
    model = nn.Linear(10, 1)  # tf.keras.layers.Dense(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

working_dir = os.environ.get("CHECKPOINT_DIR", "./ps_training")
# the tutorial's ModelCheckpoint (BackupAndRestore is not supported under this strategy yet)
callbacks = [sg.callbacks.ModelCheckpoint(os.path.join(working_dir, "ckpt"))]
history = sg.fit(model, optimizer, "mse", dataset_fn, epochs=5, steps_per_epoch=20, callbacks=callbacks, verbose=0)
print(f"fit: loss per epoch {', '.join(f'{v:.4f}' for v in history.history['loss'])}")


# --- training with a custom training loop: data preparation -------------------------------------
feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]


def feature_preprocess_stage(words):  # the tutorial's StringLookup: 0 for an unknown word
    return [feature_vocab.index(w) + 1 if w in feature_vocab else 0 for w in words]


def label_preprocess_stage(label):
    return label_vocab.index(label)  # "yes" -> 0, "no" -> 1


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        label = "yes" if "avenger" in features else "no"
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


examples = feature_and_label_gen()


def dataset_fn(_):
    features = torch.tensor([feature_preprocess_stage(f) for f in examples["features"]])
    labels = torch.tensor([label_preprocess_stage(v) for v in examples["label"]])
    raw_dataset = sg.data.Dataset.from_tensor_slices((features, labels))
    return raw_dataset.shuffle(200, seed=0).batch(32).repeat()


# --- build the model ----------------------------------------------------------------------------
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        # 8 x 16384 floats (512 KiB): MinSizePartitioner splits it in 2 shards of rows
        self.emb_layer = nn.Embedding(len(feature_vocab) + 1, 16384)
        self.dense = nn.Linear(16384, 1)

    def forward(self, features):
        emb_output = self.emb_layer(features).mean(1)
        return torch.sigmoid(self.dense(emb_output))  # Dense(1, activation="sigmoid"): [batch, 1]


with strategy.scope():
    model = Model()
    # the tutorial's RMSprop takes no sparse gradient in torch; an embedding table read row by
    # row wants SGD (no momentum), Adagrad or SparseAdam
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-3)
    accuracy = sg.metrics.Accuracy()


# --- define the training step -------------------------------------------------------------------
def step_fn(iterator):
    def replica_fn(batch_data, labels):
        optimizer.zero_grad()  # tf.GradientTape
        pred = model(batch_data)
        per_example_loss = sg.losses.BinaryCrossentropy(reduction=sg.losses.Reduction.NONE)(labels.float(), pred)
        loss = sg.compute_average_loss(per_example_loss)
        loss.backward()
        optimizer.step()  # optimizer.apply_gradients
        actual_pred = (pred > 0.5).long()
        # a metric made in scope and updated here reaches the chief's `accuracy`
        accuracy.update_state(labels, actual_pred)
        return loss.detach()

    batch_data, labels = next(iterator)
    losses = strategy.run(replica_fn, args=(batch_data, labels))
    return strategy.reduce(sg.ReduceOp.SUM, losses, axis=None)


# --- dispatch training steps to remote workers --------------------------------------------------
coordinator = sg.coordinator.ClusterCoordinator(strategy)

per_worker_dataset = coordinator.create_per_worker_dataset(dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

num_epochs = 4
steps_per_epoch = 5
for i in range(num_epochs):
    accuracy.reset_state()  # reset_states() in TF 2's Keras
    for _ in range(steps_per_epoch):
        coordinator.schedule(step_fn, args=(per_worker_iterator,))
    # Wait at epoch boundaries.
    coordinator.join()
    print("Finished epoch %d, accuracy is %f." % (i, float(accuracy.result())))

loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
print("Final loss is %f" % float(loss.fetch()))


# --- evaluation: inline, on the chief -----------------------------------------------------------
eval_examples = feature_and_label_gen(num_examples=16)
eval_features = torch.tensor([feature_preprocess_stage(f) for f in eval_examples["features"]])
eval_labels = torch.tensor([label_preprocess_stage(v) for v in eval_examples["label"]])
eval_dataset = sg.data.Dataset.from_tensor_slices((eval_features, eval_labels)).batch(8)

eval_accuracy = sg.metrics.Accuracy()


def eval_step(batch_data, labels):
    pred = model(batch_data)
    actual_pred = (pred > 0.5).long()
    eval_accuracy.update_state(labels, actual_pred)


with torch.no_grad():
    for batch_data, labels in eval_dataset:
        # strategy.run on the chief first reads the variables' current values from the ps tasks
        # (a bare model(batch_data) here would compute with the values the chief read last)
        strategy.run(eval_step, args=(batch_data, labels))

print(f"Evaluation accuracy: {float(eval_accuracy.result()):f}")
