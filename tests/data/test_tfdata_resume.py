"""Exact resume from every position for the tf.data entry points of issue 15 (windows,
groups, mixtures, generators, stateful transforms, records, CSV, saved datasets)."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

from stratagem.data import (
    Dataset,
    FixedLenFeature,
    FixedLengthRecordDataset,
    TFRecordDataset,
    TFRecordWriter,
    VarLenFeature,
    assert_resumes_exactly,
    encode_example,
    make_csv_dataset,
    parse_single_example,
)
from stratagem.data.csv import CsvDataset
from stratagem.data.spec import TensorSpec

D = Dataset
REF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_reference")


def _seq(x: int) -> torch.Tensor:
    return torch.full((x % 5 + 1,), x)


def _ragged_parts(r):
    return (r.values, r.row_splits)


def _gen():
    for i in range(9):
        yield {"a": list(range(i % 4)), "b": i / 2}


SPEC = {"id": FixedLenFeature([2], torch.int64), "tokens": VarLenFeature(torch.int64)}


def _parsed(record: bytes):
    out = parse_single_example(record, SPEC)
    return out["id"], out["tokens"]


PIPELINES = {
    "window": lambda: D.range(11).window(4, 3, 2).flat_map(lambda w: w.batch(4)),
    "window drop_remainder shift>size": lambda: D.range(17).window(2, 5, 1, True).flat_map(
        lambda w: w.batch(2)),
    "window of tuples": lambda: D.zip((D.range(8), D.range(8).map(lambda x: -x))).window(3, 1)
    .flat_map(lambda a, b: D.zip((a, b)).batch(3)),
    "group_by_window": lambda: D.range(20).group_by_window(
        lambda x: x % 3, lambda k, w: w.batch(2), window_size=3),
    "group_by_window shuffled": lambda: D.range(24).shuffle(6, seed=3).group_by_window(
        lambda x: x % 4, lambda k, w: w.map(lambda x: x * 10 + k), window_size_func=lambda k: k + 1),
    "bucket_by_sequence_length": lambda: D.range(25).map(_seq).bucket_by_sequence_length(
        len, [2, 4], [3, 2, 2], pad_to_bucket_boundary=False),
    "ragged_batch": lambda: D.range(13).map(_seq).ragged_batch(4).map(_ragged_parts),
    "choose_from_datasets": lambda: D.choose_from_datasets(
        [D.range(5), D.range(100, 108)], D.from_tensor_slices([0, 1, 1, 0, 1, 0, 0, 1, 0, 1]),
        stop_on_empty_dataset=False),
    "sample_from_datasets": lambda: D.sample_from_datasets(
        [D.range(6), D.range(100, 110).shuffle(4, seed=2), D.range(200, 203)], [0.5, 0.3, 0.2],
        seed=7),
    "sample_from_datasets unseeded": lambda: D.sample_from_datasets([D.range(7), D.range(50, 57)]),
    "rejection_resample": lambda: D.range(50).rejection_resample(
        lambda x: int(x % 4 == 0), [0.5, 0.5], seed=3),
    "from_generator signature": lambda: D.from_generator(
        _gen, output_signature={"a": TensorSpec((None,), torch.int32),
                                "b": TensorSpec((), torch.float64)}),
    "scan": lambda: D.range(12).scan((0, torch.zeros(2)), lambda s, x: (
        (s[0] + x, s[1] + x), s[0] * x)),
    "take_while": lambda: D.range(30).take_while(lambda x: x < 9),
    "unique": lambda: D.from_tensor_slices([3, 1, 3, 2, 1, 5, 2, 7]).unique(),
    "unique strings": lambda: D.from_tensor_slices(["b", "a", "b", "c", "a"]).unique(),
    "counter random": lambda: D.zip((D.counter(5, 3), D.random(seed=4))).take(8),
    "sparse_batch": lambda: D.range(11).map(_seq).sparse_batch(3, [5]).map(
        lambda s: s.to_dense()),
    "rebatch cycled sizes": lambda: D.range(17).batch(4).rebatch([3, 1, 2]),
    "assert_cardinality": lambda: D.range(9).filter(lambda x: x % 2).assert_cardinality(4),
    "csv": lambda: CsvDataset([os.path.join(REF, "a.csv"), os.path.join(REF, "b.csv")],
                              [0, "", [0.0], [torch.tensor(0)], ""], header=True, na_value="NA"),
    "make_csv_dataset shuffled": lambda: make_csv_dataset(
        os.path.join(REF, "*.csv"), 2, num_epochs=2, shuffle_seed=5, shuffle_buffer_size=3,
        na_value="NA", label_name="id"),
    "tfrecord gzip": lambda: TFRecordDataset(os.path.join(REF, "records.tfrecord.gz"), "GZIP"),
    "fixed length gzip footer": lambda: FixedLengthRecordDataset(
        [os.path.join(REF, "fixed.bin.gz")] * 2, 5, 0, 5, compression_type="GZIP"),
    "fixed length header": lambda: FixedLengthRecordDataset(os.path.join(REF, "fixed.bin"), 4, 2),
    "tfrecord zlib": lambda: TFRecordDataset(os.path.join(REF, "records.tfrecord.zlib"), "ZLIB"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(PIPELINES))
@pytest.mark.slow
def test_resumes_exactly_from_every_position(name):
    reference = assert_resumes_exactly(PIPELINES[name], [0])
    assert reference, "the pipeline yields elements"
    assert_resumes_exactly(PIPELINES[name], range(1, len(reference) + 1))


def _examples(path: str) -> None:
    with TFRecordWriter(path, "GZIP") as w:
        for i in range(7):
            w.write(encode_example({"id": [i, -i], "tokens": list(range(i % 3))}))


@pytest.mark.timeout(60)
def test_parsed_examples_resume_also_on_threads(tmp_path):
    path = str(tmp_path / "ex.tfrecord.gz")
    _examples(path)
    serial = assert_resumes_exactly(lambda: TFRecordDataset(path, "GZIP").map(_parsed), range(8))
    parallel = assert_resumes_exactly(
        lambda: TFRecordDataset(path, "GZIP").map(_parsed, num_parallel_calls=3), range(8))
    assert serial == parallel and len(serial) == 7


@pytest.mark.timeout(60)
def test_saved_and_snapshot_datasets_resume(tmp_path):
    src = D.range(14).map(lambda x: (x, str(int(x))))  # tf: tf.strings.as_string(x)
    src.save(str(tmp_path / "saved"), shard_func=lambda x, s: x % 3)
    ref = assert_resumes_exactly(lambda: D.load(str(tmp_path / "saved")), range(15))
    # shards one after another
    assert sorted(e["tuple"][0]["values"][0] for e in ref) == list(range(14))
    snap = str(tmp_path / "snap")
    # the reference pass writes the snapshot; every later pass (and restore) reads it
    assert_resumes_exactly(lambda: src.snapshot(snap), range(15))
    assert len(os.listdir(snap)) == 1


@pytest.mark.timeout(60)
def test_snapshot_write_pass_resumed_does_not_write(tmp_path):
    snap = str(tmp_path / "snap")
    ds = D.range(6).snapshot(snap)
    it = ds.iterator(epoch=0, seed=1)
    assert [next(it), next(it)] == [0, 1]
    state = it.state_dict()
    it.close()
    assert not os.path.exists(snap) or os.listdir(snap) == [], "an unfinished pass leaves nothing"
    assert list(ds.iterator_from_state(state)) == [2, 3, 4, 5]
    assert not os.path.exists(snap) or os.listdir(snap) == []
    assert list(ds) == list(range(6)) and len(os.listdir(snap)) == 1


def _mixture():
    return D.sample_from_datasets(
        [D.range(10).window(3, 2).flat_map(lambda w: w.batch(3)),
         D.range(100, 120).group_by_window(lambda x: x % 2, lambda k, w: w.batch(3), 3)],
        seed=11)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_mixture_of_windows_resumes_in_a_fresh_process():
    assert_resumes_exactly(_mixture, [4], fresh_process=True)


def test_unseeded_mixture_is_deterministic_under_options_seed():
    from stratagem.data import Options

    def make():
        o = Options()
        o.seed = 42
        return D.sample_from_datasets([D.range(20), D.range(100, 120)]).with_options(o)

    a, b = list(make()), list(make())
    assert a == b and sorted(a) == list(range(20)) + list(range(100, 120))
    epochs = make()
    assert list(epochs) != list(epochs), "a new epoch draws anew"


def test_partial_of_parse_is_picklable_for_process_maps():
    import pickle

    fn = functools.partial(parse_single_example, features=SPEC)
    assert pickle.loads(pickle.dumps(fn)).keywords["features"] == SPEC
    assert np.array_equal(fn(encode_example({"id": [1, 2], "tokens": [5]}))["id"], [1, 2])
