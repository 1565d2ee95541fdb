"""TensorFlow's tutorial "Distributed input", in stratagem.

https://www.tensorflow.org/tutorials/distribute/input, cell by cell, with its names and in its
order. The tutorial simulates 2 CPUs with virtual devices in one process; stratagem runs one
process per replica, so ``MirroredStrategy("cpu", num_replicas=N_VIRTUAL_DEVICES)`` starts the
second replica itself (the script runs once per replica). What tf's one process prints once, the
chief prints (``sg.print``); a per-replica value (what ``strategy.run`` returns) is printed with
every replica's part, gathered by ``strategy.experimental_local_results``, as tf prints a
``PerReplica``. Cells that need something stratagem does not have (Keras's ``IntegerLookup`` on a
vocabulary file, ParameterServerStrategy's coordinator, TensorFlow Transform) are noted where
they stand. Run: ``python examples/tutorials/distributed_input.py``.
"""

import numpy as np
import torch

import stratagem as sg
from stratagem.distribute import PerReplica

print_ = sg.print  # tf's one process prints once; here the chief prints


def show(strategy, value):
    """tf prints a per-replica value as ``PerReplica:{0: ..., 1: ...}``: every replica's part."""
    return PerReplica(strategy.experimental_local_results(value))


# ## Distributed datasets

print_(torch.__version__)  # print(tf.__version__)

# Simulate multiple CPUs with virtual devices
N_VIRTUAL_DEVICES = 2
mirrored_strategy = sg.MirroredStrategy("cpu", num_replicas=N_VIRTUAL_DEVICES)  # tf.config.set_logical_device_configuration

print_("Available devices:")
for i, device in enumerate(mirrored_strategy.devices):  # tf.config.list_logical_devices()
    print_("%d) %s" % (i, device))  # noqa: UP031

global_batch_size = 16
# Create a tf.data.Dataset object.
dataset = sg.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)


@sg.function(backend="aot_eager", dynamic=True)  # tf.function; the last batch is partial
def train_step(inputs):
    features, labels = inputs
    return labels - 0.3 * features


# Iterate over the dataset using the for..in construct.
for inputs in dataset:
    print_(train_step(inputs))

# ### tf.distribute.Strategy.experimental_distribute_dataset
# #### Usage

global_batch_size = 16
dataset = sg.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)
# Distribute input using the `experimental_distribute_dataset`.
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
# 1 global batch of data fed to the model in 1 step.
print_(show(mirrored_strategy, next(iter(dist_dataset))))

# #### Properties: batching (the tutorial's three examples, here on 2 replicas)
for d in (sg.data.Dataset.range(6).batch(4, drop_remainder=False), sg.data.Dataset.range(4).batch(4),
          sg.data.Dataset.range(8).batch(4)):  # fmt: skip
    print_("Rebatched:", [[p.tolist() for p in mirrored_strategy.experimental_local_results(b)]
                          for b in mirrored_strategy.experimental_distribute_dataset(d)])  # fmt: skip

# #### Properties: sharding
dataset = sg.data.Dataset.from_tensors(([1.0], [1.0])).repeat(64).batch(16)
options = sg.data.Options()
options.experimental_distribute.auto_shard_policy = sg.data.AutoShardPolicy.DATA
dataset = dataset.with_options(options)

# ### tf.distribute.Strategy.distribute_datasets_from_function
# #### Usage


def dataset_fn(input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = sg.data.Dataset.from_tensors(([1.0], [1.0])).repeat(64).batch(16)
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(2)  # This prefetches 2 batches per device.
    return dataset


dist_dataset = mirrored_strategy.distribute_datasets_from_function(dataset_fn)
print_("From function:", [tuple(t.shape) for t in next(iter(dist_dataset))])

# ## Distributed iterators
# #### Use a Pythonic for loop construct

global_batch_size = 16
dataset = sg.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


@sg.function(backend="aot_eager", dynamic=True)  # tf.function; the last batch is partial
def train_step(inputs):  # noqa: F811 (the tutorial defines it again)
    features, labels = inputs
    return labels - 0.3 * features


for x in dist_dataset:
    # train_step trains the model using the dataset elements
    loss = mirrored_strategy.run(train_step, args=(x,))
    print_("Loss is ", show(mirrored_strategy, loss))

# #### Use `iter` to create an explicit iterator

num_epochs = 10
steps_per_epoch = 5
for epoch in range(num_epochs):  # noqa: B007
    dist_iterator = iter(dist_dataset)
    for step in range(steps_per_epoch):  # noqa: B007
        # train_step trains the model using the dataset elements
        loss = mirrored_strategy.run(train_step, args=(next(dist_iterator),))
        # which is the same as
        # loss = mirrored_strategy.run(train_step, args=(dist_iterator.get_next(),))
        print_("Loss is ", show(mirrored_strategy, loss))

# You can break the loop with `get_next_as_optional` by checking if the `Optional` contains a value
global_batch_size = 4
steps_per_loop = 5
strategy = mirrored_strategy  # tf.distribute.MirroredStrategy() (one strategy per process here)

dataset = sg.data.Dataset.range(9).batch(global_batch_size)
distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))


def train_fn(distributed_iterator):  # @tf.function with a tf.range loop: a Python loop here
    for _ in range(steps_per_loop):
        optional_data = distributed_iterator.get_next_as_optional()
        if not optional_data.has_value():
            break
        per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
        sg.print(strategy.experimental_local_results(per_replica_results))  # tf.print


train_fn(distributed_iterator)

# ## Using the `element_spec` property

global_batch_size = 16
epochs = 5
steps_per_epoch = 5

dataset = sg.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
print_("element_spec:", dist_dataset.element_spec)


@sg.function(backend="aot_eager", dynamic=True)  # tf.function(input_signature=[dist_dataset.element_spec])
def train_step(per_replica_inputs):  # noqa: F811
    def step_fn(inputs):
        return 2 * inputs

    return mirrored_strategy.run(step_fn, args=(per_replica_inputs,))


for _ in range(epochs):
    iterator = iter(dist_dataset)
    for _ in range(steps_per_epoch):
        output = train_step(next(iterator))
        sg.print(show(mirrored_strategy, output))  # tf.print(output)

# ## Data preprocessing: a custom training loop
# tf.keras.layers.StringLookup(vocabulary=vocab) is a Keras preprocessing layer; stratagem has
# none, so here is the same lookup (index 0 for out-of-vocabulary, then the vocabulary in order).


class StringLookup(torch.nn.Module):
    def __init__(self, vocabulary):
        super().__init__()
        self.table = {w: i + 1 for i, w in enumerate(vocabulary)}

    def forward(self, strings):  # a batch of strings: a numpy array of str (tf: a tf.string tensor)
        return torch.tensor([self.table.get(str(s), 0) for s in strings], dtype=torch.int64)


vocab = ["a", "b", "c", "d", "f"]

with strategy.scope():
    # Create the layer(s) under scope.
    layer = StringLookup(vocabulary=vocab)


def dataset_fn(input_context):  # noqa: F811
    # a tf.data.Dataset
    dataset = sg.data.Dataset.from_tensor_slices(["a", "c", "e"]).repeat()

    # Custom your batching, sharding, prefetching, etc.
    global_batch_size = 4
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = dataset.batch(batch_size)
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

    # Apply the preprocessing layer(s) to the tf.data.Dataset
    def preprocess_with_kpl(input):
        return layer(input)

    processed_ds = dataset.map(preprocess_with_kpl)
    return processed_ds


distributed_dataset = strategy.distribute_datasets_from_function(dataset_fn)

# Print out a few example batches.
distributed_dataset_iterator = iter(distributed_dataset)
for _ in range(3):
    print_(show(strategy, next(distributed_dataset_iterator)))

# ## Caveats: ordering the outputs of a distributed prediction

dataset_size = 24
batch_size = 6
dataset = sg.data.Dataset.range(dataset_size).enumerate().batch(batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


def predict(index, inputs):
    outputs = 2 * inputs
    return index, outputs


result = {}
for index, inputs in dist_dataset:
    output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
    indices = list(mirrored_strategy.experimental_local_results(output_index))
    rindices = []
    for a in indices:
        rindices.extend(a.numpy())
    outputs = list(mirrored_strategy.experimental_local_results(outputs))
    routputs = []
    for a in outputs:
        routputs.extend(a.numpy())
    for i, value in zip(rindices, routputs):
        result[i] = value

print_(result)

# ## Tensor inputs instead of tf.data
# ### Use experimental_distribute_values_from_function for arbitrary tensor inputs


def value_fn(ctx):
    return torch.tensor(ctx.replica_id_in_sync_group)  # tf.constant


distributed_values = mirrored_strategy.experimental_distribute_values_from_function(value_fn)
for _ in range(4):
    result = mirrored_strategy.run(lambda x: x, args=(distributed_values,))
    print_(show(mirrored_strategy, result))

# ### Use tf.data.Dataset.from_generator if your input is from a generator


np.random.seed(0)  # every replica runs the generator: seeded, they yield the same global batches


def input_gen():
    while True:
        yield np.random.rand(4)


# use Dataset.from_generator
dataset = sg.data.Dataset.from_generator(input_gen, output_types=(torch.float32), output_shapes=[4])
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
iterator = iter(dist_dataset)
for _ in range(4):
    result = mirrored_strategy.run(lambda x: x, args=(next(iterator),))
    print_(show(mirrored_strategy, result))
