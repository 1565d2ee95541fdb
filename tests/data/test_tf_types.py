"""tf.data's element types (issue 30, part 4): elements are tensors converted as
tf.convert_to_tensor converts Python values, element_spec describes what iteration yields for
every source and transformation (also on a distributed dataset), iterators have get_next /
get_next_as_optional, and AUTOTUNE pays no separate probe. Each test is written as a TF user
writes the code (tf.data.Dataset -> stratagem.data.Dataset), asserting TF's answer."""

from __future__ import annotations

import collections
import time

import numpy as np
import pytest
import torch

import stratagem as sg
import stratagem.data as sgd
from stratagem.data import AUTOTUNE, Dataset, TensorSpec
from stratagem.data.spec import DatasetSpec, RaggedSpec
from stratagem.data.structure import flatten
from stratagem.testing import run_workers

# -- conversion as tf.convert_to_tensor ---------------------------------------------------------


def test_from_tensors_lists_are_tensors_so_map_doubles_them():
    # the case: tf gives (<tf.Tensor: [2.]>, <tf.Tensor: [1.]>)
    dataset = Dataset.from_tensors(([1.0], [1.0]))
    dataset = dataset.map(lambda f, l: (f * 2, l))  # noqa: E741 - the issue's code
    ((f, label),) = list(dataset)
    assert isinstance(f, torch.Tensor) and f.dtype == torch.float32 and f.tolist() == [2.0]
    assert isinstance(label, torch.Tensor) and label.dtype == torch.float32
    assert label.tolist() == [1.0]
    assert dataset.element_spec == (TensorSpec((1,), torch.float32),
                                    TensorSpec((1,), torch.float32))


def test_from_tensor_slices_batch_element_spec_is_what_the_batches_are():
    # the case: tf says TensorSpec(shape=(None,), dtype=tf.float32)
    dataset = Dataset.from_tensor_slices([1.0, 2.0, 3.0]).batch(3)
    assert dataset.element_spec == TensorSpec((None,), torch.float32)
    (batch,) = list(dataset)
    assert batch.dtype == torch.float32 and batch.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("value, dtype, shape", [
    ([1, 2, 3], torch.int32, ()),  # tf: Python int -> int32
    ([[1.0, 2.0], [3.0, 4.0]], torch.float32, (2,)),  # Python float -> float32
    ([True, False], torch.bool, ()),
    ([1, 2 ** 40], torch.int64, ()),  # tf: int64 when int32 cannot hold a value
    (np.array([1.0, 2.0]), torch.float64, ()),  # numpy keeps its dtype, float64 included
    (np.array([1, 2], dtype=np.int16), torch.int16, ()),
    (torch.tensor([1, 2], dtype=torch.uint8), torch.uint8, ()),
])
def test_from_tensor_slices_dtypes_as_tf(value, dtype, shape):
    dataset = Dataset.from_tensor_slices(value)
    assert dataset.element_spec == TensorSpec(shape, dtype)
    for element in dataset:
        assert isinstance(element, torch.Tensor)
        assert element.dtype == dtype and tuple(element.shape) == shape


def test_python_scalars_and_numpy_values_in_from_tensors():
    dataset = Dataset.from_tensors({"a": 1, "b": 2.5, "c": np.float64(0.5), "d": True})
    (element,) = list(dataset)
    assert {k: v.dtype for k, v in element.items()} == {
        "a": torch.int32, "b": torch.float32, "c": torch.float64, "d": torch.bool}
    assert dataset.element_spec["c"] == TensorSpec((), torch.float64)


def test_tuples_are_structure_lists_are_tensors():
    features = Dataset.from_tensor_slices(([1, 2], [3.0, 4.0]))  # a tuple: two components
    assert features.element_spec == (TensorSpec((), torch.int32), TensorSpec((), torch.float32))
    stacked = Dataset.from_tensor_slices([[1, 2], [3, 4]])  # a list: one (2, 2) tensor
    assert stacked.element_spec == TensorSpec((2,), torch.int32)
    assert [x.tolist() for x in stacked] == [[1, 2], [3, 4]]
    Point = collections.namedtuple("Point", "x y")
    (p,) = list(Dataset.from_tensors(Point(1.0, [2.0, 3.0])))
    assert isinstance(p, Point) and p.y.dtype == torch.float32 and p.y.shape == (2,)


def test_a_ragged_list_is_an_error_naming_what_to_do():
    with pytest.raises(ValueError, match="non-rectangular.*padded_batch"):
        Dataset.from_tensors([[1, 2], [3]])


def test_map_results_are_converted_and_a_returned_list_is_a_tuple():
    # tf: a map function's list result is a tuple of components, Python numbers are tensors
    dataset = Dataset.range(3).map(lambda x: [x, 2.0, 7])
    assert dataset.element_spec == (TensorSpec((), torch.int64), TensorSpec((), torch.float32),
                                    TensorSpec((), torch.int32))
    first = next(iter(dataset))
    assert isinstance(first, tuple) and [t.dtype for t in first] == [
        torch.int64, torch.float32, torch.int32]
    parallel = Dataset.range(3).map(lambda x: [x, 2.0, 7], num_parallel_calls=2)
    assert [tuple(t.dtype for t in e) for e in parallel] == [
        (torch.int64, torch.float32, torch.int32)] * 3


def test_range_counter_random_enumerate_yield_int64_tensors():
    for dataset in (Dataset.range(3), Dataset.counter().take(3), Dataset.random(seed=1).take(3)):
        assert dataset.element_spec == TensorSpec((), torch.int64)
        assert all(isinstance(x, torch.Tensor) and x.dtype == torch.int64 for x in dataset)
    assert [int(x) for x in Dataset.range(3)] == [0, 1, 2]
    index, value = next(iter(Dataset.from_tensor_slices([5.0]).enumerate()))
    assert index.dtype == torch.int64 and int(index) == 0 and value.dtype == torch.float32


def test_generator_signature_converts_like_tf():
    # the tf.data performance guide's ArtificialDataset yields a 1-tuple under a (1,)
    # signature: tf converts the whole value to one tensor of shape (1,)
    def generator(num_samples):
        for sample_idx in range(num_samples):
            yield (sample_idx,)

    dataset = Dataset.from_generator(
        generator, output_signature=TensorSpec(shape=(1,), dtype=torch.int64), args=(3,))
    assert [(x.dtype, x.tolist()) for x in dataset] == [(torch.int64, [i]) for i in range(3)]

    def pairs():
        yield 1.5, [1, 2]
        yield 2.5, [3, 4]

    plain = Dataset.from_generator(pairs)  # no signature: converted as tf converts values
    assert [(a.dtype, b.dtype) for a, b in plain] == [(torch.float32, torch.int32)] * 2
    assert plain.element_spec == (TensorSpec((), torch.float32), TensorSpec((2,), torch.int32))


def test_strings_stay_text_and_as_numpy_iterator_gives_bytes():
    dataset = Dataset.from_tensor_slices(["a", "bc"])
    assert dataset.element_spec == TensorSpec((), "string")
    assert list(dataset) == ["a", "bc"]
    # tf: [b'a', b'bc']
    assert list(dataset.as_numpy_iterator()) == [b"a", b"bc"]
    (batch,) = list(dataset.batch(2).as_numpy_iterator())
    assert batch.dtype == object and batch.tolist() == [b"a", b"bc"]
    assert list(Dataset.from_tensors("hi").as_numpy_iterator()) == [b"hi"]


def test_as_numpy_iterator_as_tf_documents_it():
    dataset = Dataset.from_tensor_slices([1, 2, 3])
    assert list(dataset.as_numpy_iterator()) == [1, 2, 3]
    assert all(isinstance(x, np.int32) for x in dataset.as_numpy_iterator())
    dataset = Dataset.from_tensor_slices({"a": ([1, 2], [3, 4]), "b": [5, 6]})
    got = list(dataset.as_numpy_iterator())
    assert got == [{"a": (1, 3), "b": 5}, {"a": (2, 4), "b": 6}]
    assert list(Dataset.range(2).as_numpy_iterator()) == [np.int64(0), np.int64(1)]


def test_from_torch_keeps_torch_conventions_for_labels():
    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.zeros(2), i  # an int label: CrossEntropyLoss wants int64

    (_, label), _ = list(Dataset.from_torch(Pairs()))
    assert label.dtype == torch.int64


# -- element_spec is what iteration yields ------------------------------------------------------


def _lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one\ntwo\nthree\n")
    return str(path)


def _gen():
    for i in range(5):
        yield {"x": np.full((2,), i, np.float32), "y": i}


SOURCES = {
    "range": lambda tmp: Dataset.range(7),
    "slices floats": lambda tmp: Dataset.from_tensor_slices([1.0, 2.0, 3.0, 4.0, 5.0]),
    "slices ints": lambda tmp: Dataset.from_tensor_slices([[1, 2], [3, 4], [5, 6]]),
    "slices numpy float64": lambda tmp: Dataset.from_tensor_slices(np.ones((6, 2))),
    "slices tuple": lambda tmp: Dataset.from_tensor_slices((np.arange(6.0), ["a"] * 6)),
    "slices dict": lambda tmp: Dataset.from_tensor_slices({"a": [1.0, 2.0], "b": [[1], [2]]}),
    "tensors": lambda tmp: Dataset.from_tensors(([1.0], 2, "s")),
    "generator": lambda tmp: Dataset.from_generator(_gen),
    "generator signature": lambda tmp: Dataset.from_generator(
        _gen, output_signature={"x": TensorSpec((2,), torch.float32),
                                "y": TensorSpec((), torch.int64)}),
    "counter": lambda tmp: Dataset.counter(3).take(4),
    "random": lambda tmp: Dataset.random(seed=2).take(4),
    "text lines": lambda tmp: sgd.TextLineDataset(_lines(tmp)),
    "list_files": lambda tmp: Dataset.list_files(_lines(tmp)),
}

TRANSFORMS = {
    "map": lambda ds: ds.map(lambda *x: x),
    "map parallel": lambda ds: ds.map(lambda *x: x, num_parallel_calls=AUTOTUNE),
    "batch": lambda ds: ds.batch(2),
    "batch drop": lambda ds: ds.batch(2, drop_remainder=True),
    "padded_batch": lambda ds: ds.padded_batch(2),
    "filter": lambda ds: ds.filter(lambda *x: True),
    "shuffle": lambda ds: ds.shuffle(3, seed=1),
    "zip": lambda ds: Dataset.zip((ds, Dataset.range(100))),
    "concatenate": lambda ds: ds.concatenate(ds),
    "window": lambda ds: ds.window(2),
    "flat_map": lambda ds: ds.flat_map(
        lambda *x: Dataset.from_tensors(x[0] if len(x) == 1 else x).repeat(2)),
    "interleave": lambda ds: Dataset.range(2).interleave(lambda _: ds, cycle_length=2),
    "enumerate": lambda ds: ds.enumerate(),
    "repeat take skip": lambda ds: ds.repeat(2).skip(1).take(5),
    "prefetch": lambda ds: ds.prefetch(2),
    "cache": lambda ds: ds.cache(),
    "unbatch": lambda ds: ds.batch(2).unbatch(),
}


def _check_leaf(spec, leaf, where):
    if isinstance(spec, DatasetSpec):
        assert isinstance(leaf, Dataset), where
        for element in leaf:
            _check_element(spec.element_spec, element, where + " (window)")
        return
    assert isinstance(spec, TensorSpec | RaggedSpec), where
    if spec.dtype == "string":
        assert isinstance(leaf, str | bytes | np.ndarray), (where, leaf)
        shape = np.shape(leaf) if isinstance(leaf, np.ndarray) else ()
    else:
        assert isinstance(leaf, torch.Tensor), (where, type(leaf))
        assert leaf.dtype == spec.dtype, (where, leaf.dtype, spec)
        shape = tuple(leaf.shape)
    if spec.shape is not None:
        assert len(shape) == len(spec.shape) and all(
            d is None or d == s for d, s in zip(spec.shape, shape)), (where, shape, spec)


def _check_element(spec, element, where):
    specs, leaves = flatten(spec), flatten(element)
    assert len(specs) == len(leaves), (where, spec, element)
    for s, leaf in zip(specs, leaves):
        _check_leaf(s, leaf, where)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_element_spec_of_every_source_is_what_it_yields(source, tmp_path):
    dataset = SOURCES[source](tmp_path)
    spec = dataset.element_spec
    elements = list(dataset)
    assert elements
    for element in elements:
        _check_element(spec, element, source)


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("source", ["slices floats", "slices tuple", "generator", "tensors"])
def test_element_spec_of_transformations_is_what_they_yield(source, transform, tmp_path):
    dataset = TRANSFORMS[transform](SOURCES[source](tmp_path))
    spec = dataset.element_spec
    for element in dataset:
        _check_element(spec, element, f"{source} {transform}")


# -- get_next / get_next_as_optional -----------------------------------------------------------


def test_get_next_and_out_of_range_as_tf():
    dataset = Dataset.range(2)
    iterator = iter(dataset)
    assert int(iterator.get_next()) == 0
    assert int(iterator.get_next()) == 1
    with pytest.raises(sgd.OutOfRangeError):  # tf.errors.OutOfRangeError
        iterator.get_next()
    assert iterator.element_spec == TensorSpec((), torch.int64)


def test_get_next_as_optional_as_tf():
    dataset = Dataset.from_tensor_slices([1.0, 2.0])
    iterator = iter(dataset)
    values = []
    while True:
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        values.append(float(optional.get_value()))
    assert values == [1.0, 2.0]
    assert optional.element_spec == TensorSpec((), torch.float32)
    with pytest.raises(sgd.InvalidArgumentError, match="empty Optional"):
        optional.get_value()
    assert sgd.Optional.from_value(3).get_value().dtype == torch.int32


# -- distributed datasets -----------------------------------------------------------------------


def distributed_worker() -> dict:
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    features = np.arange(16, dtype=np.float32).reshape(8, 2)
    dataset = Dataset.from_tensor_slices((features, [0, 1] * 4)).batch(4, drop_remainder=True)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    out = {"spec": repr(dist_dataset.element_spec)}
    iterator = iter(dist_dataset)
    x, y = iterator.get_next()
    out["first"] = (tuple(x.shape), x.dtype == torch.float32, y.dtype == torch.int32)
    optional = iterator.get_next_as_optional()
    out["second"] = optional.has_value() and tuple(optional.get_value()[0].shape)
    out["end"] = iterator.get_next_as_optional().has_value()
    try:
        iterator.get_next()
        out["raised"] = False
    except sgd.OutOfRangeError:
        out["raised"] = True
    uneven = strategy.experimental_distribute_dataset(Dataset.range(6).batch(4))
    out["uneven"] = repr(uneven.element_spec)
    per_replica = strategy.distribute_datasets_from_function(
        lambda ctx: Dataset.range(8).batch(ctx.get_per_replica_batch_size(4)))
    out["from_function"] = repr(per_replica.element_spec)
    return out


@pytest.mark.timeout(180)
def test_distributed_dataset_element_spec_and_get_next():
    results = [r.value for r in run_workers(distributed_worker, 2)]
    # tf: the per-replica spec, batch 4 over 2 replicas is 2
    expected_spec = repr((TensorSpec((2, 2), torch.float32), TensorSpec((2,), torch.int32)))
    for out in results:
        assert out["spec"] == expected_spec
        assert out["first"] == ((2, 2), True, True)
        assert out["second"] == (2, 2)
        assert out["end"] is False and out["raised"] is True
        assert out["uneven"] == repr(TensorSpec((None,), torch.int64))
        assert out["from_function"] == repr(TensorSpec((None,), torch.int64))


def test_one_process_distributed_dataset_spec():
    strategy = sg.OneDeviceStrategy("cpu")
    dataset = Dataset.from_tensor_slices([1.0, 2.0, 3.0]).batch(2)
    dist = strategy.experimental_distribute_dataset(dataset)
    assert dist.element_spec == TensorSpec((None,), torch.float32)
    iterator = iter(dist)
    assert iterator.get_next().tolist() == [1.0, 2.0]
    assert iterator.get_next_as_optional().get_value().tolist() == [3.0]
    assert not iterator.get_next_as_optional().has_value()


# -- AUTOTUNE: no probe, the sequential map's answer --------------------------------------------


class Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, x):
        self.calls += 1
        return self.fn(x)


def _sleepy(x):
    time.sleep(0.003)
    return x * 2


def _python_work(x):
    total = 0
    for i in range(20_000):
        total = (total * 31 + i) % 1_000_003
    return x + total


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fn", [_sleepy, _python_work, lambda x: x + 1])
def test_autotune_map_has_no_probe_and_the_sequential_answer(fn):
    starts = []

    def generator():
        starts.append(1)
        yield from range(30)

    counting = Counting(fn)
    dataset = Dataset.from_generator(generator).map(counting, num_parallel_calls=AUTOTUNE)
    iterator = iter(dataset)
    first = next(iterator)
    # the first element costs one call on one pass over the input: nothing ran before it
    assert counting.calls == 1 and len(starts) == 1
    rest = list(iterator)
    expected = [fn(torch.tensor(i, dtype=torch.int32)) for i in range(30)]
    assert [first, *rest] == expected  # same elements, same order
    assert len(starts) == 1  # the input was read once
    if dataset._engine != "processes":  # (calls in worker processes are not counted here)
        assert counting.calls == 30  # every call made an element
    assert list(dataset) == expected and len(starts) == 2


@pytest.mark.timeout(120)
def test_autotune_first_epoch_resumes_exactly_across_the_switch():
    from stratagem.data import assert_resumes_exactly

    def make():
        return Dataset.range(40).map(_sleepy, num_parallel_calls=AUTOTUNE)

    assert_resumes_exactly(make, [0, 1, 2, 3, 9, 39])



def test_device_fed_dataset_keeps_element_spec_and_get_next():
    # on a GPU, experimental_distribute_dataset hands out a DeviceFedDataset: same spec, same API
    from stratagem.distribute.engines.device_feed import DeviceFedDataset

    strategy = sg.OneDeviceStrategy("cpu")
    dist = strategy.experimental_distribute_dataset(Dataset.range(3).batch(2))
    fed = DeviceFedDataset(dist, torch.device("cpu"), depth=1)
    assert fed.element_spec == TensorSpec((None,), torch.int64)
    iterator = iter(fed)
    assert iterator.element_spec == TensorSpec((None,), torch.int64)
    assert iterator.get_next().tolist() == [0, 1]
    assert iterator.get_next_as_optional().get_value().tolist() == [2]
    with pytest.raises(sgd.OutOfRangeError):
        iterator.get_next()
