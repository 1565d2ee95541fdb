"""tf.data's surprises fixed and clear errors: padded_batch structures, Options spellings,
signatures, reductions, mixtures, records, CSV and Example parsing."""

from __future__ import annotations

import gzip
import os
import time
import zlib

import numpy as np
import pytest
import torch

from stratagem.data import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    AutoShardPolicy,
    CsvDataset,
    CsvParseError,
    Dataset,
    ExampleParseError,
    FixedLenFeature,
    Options,
    Ragged,
    TensorSpec,
    TextLineDataset,
    TFRecordDataset,
    TFRecordOptions,
    TFRecordWriter,
    VarLenFeature,
    auto_shard,
    encode_example,
    parse_example,
    parse_single_example,
)

D = Dataset


def test_padded_batch_structure_mismatch_names_the_structures():
    ds = D.range(4).map(lambda x: (torch.arange(x), x))
    with pytest.raises(ValueError, match=r"padded_shapes \(\) does not match the structure of "
                                         r"the elements \(tensor\[0\]:int64, tensor\[\]:int64\)"):
        list(ds.padded_batch(2, padded_shapes=()))
    with pytest.raises(ValueError, match="padding_values"):
        list(ds.padded_batch(2, padding_values={"a": 1}))
    (first, _) = list(ds.padded_batch(2, padded_shapes=([5], []), padding_values=(-1, 0)))
    assert first[0].tolist() == [[-1] * 5, [0, -1, -1, -1, -1]] and first[1].tolist() == [0, 1]


def test_batched_bytes_keep_trailing_zero_bytes():
    (batch,) = list(D.from_tensor_slices([b"a\x00", b"b\x00\x00"]).batch(2))
    assert list(batch) == [b"a\x00", b"b\x00\x00"]


def _slow_first(x):
    if x == 0:
        time.sleep(0.2)
    return x


def test_experimental_deterministic_is_honoured():
    o = Options()
    o.experimental_deterministic = False
    assert o.deterministic is False and o.experimental_deterministic is False
    out = list(D.range(8).map(_slow_first, num_parallel_calls=4).with_options(o))
    assert sorted(out) == list(range(8)) and out[0] != 0
    o.experimental_deterministic = True
    assert list(D.range(8).map(_slow_first, num_parallel_calls=4).with_options(o)) == list(
        range(8))


def test_tf_option_spellings():
    o = Options()
    o.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    assert o.distribute.auto_shard_policy == AutoShardPolicy.DATA
    o.experimental_distribute.auto_shard_policy = 1  # tf's enum values are accepted
    assert o.distribute.auto_shard_policy is AutoShardPolicy.FILE
    o.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    sharded = auto_shard(D.range(8).with_options(o), 2, 1)
    assert list(sharded) == [1, 3, 5, 7]
    o.autotune.enabled, o.autotune.ram_budget, o.autotune.cpu_budget = True, 1 << 20, 2
    with pytest.raises(ValueError, match="HINT"):
        o.experimental_distribute.auto_shard_policy = 3


@pytest.mark.parametrize("name", ["experimental_optimization", "threading", "experimental_slack",
                                  "experimental_external_state_policy", "dataset_name"])
def test_tf_options_we_do_not_have_raise_naming_them(name):
    with pytest.raises(AttributeError, match=f"Options.{name}: tf.data has this option but "
                                             "stratagem does not"):
        setattr(Options(), name, True)
    with pytest.raises(AttributeError, match=name):
        getattr(Options(), name)


def test_unknown_options_raise_naming_the_attribute():
    with pytest.raises(AttributeError, match=r"Options has no option 'determinstic'; the options "
                                             r"are: autotune, deterministic"):
        Options().determinstic = False  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="DistributeOptions has no option 'policy'"):
        Options().distribute.policy = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="AutotuneOptions.initial_parallelism"):
        Options().autotune.initial_parallelism = 2  # type: ignore[attr-defined]


def test_cardinality_constants_are_tfs_and_infinite_is_detectable():
    assert (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY) == (-1, -2)
    assert D.range(3).repeat().map(lambda x: x).prefetch(AUTOTUNE).cardinality() == -1
    assert D.range(3).repeat().batch(2).cardinality() == -1
    assert D.counter().cardinality() == -1 and D.random(1).cardinality() == -1
    assert D.range(3).repeat().filter(lambda x: x).cardinality() == -2  # as tf.data
    assert D.range(3).filter(lambda x: x).cardinality() == -2
    assert D.range(10).window(3, 2, drop_remainder=True).cardinality() == 4
    assert D.range(3).assert_cardinality(3).cardinality() == 3
    with pytest.raises(ValueError, match="asserted to be 5"):
        list(D.range(3).assert_cardinality(5))


def test_from_generator_signature_errors_name_the_element():
    sig = (TensorSpec((2,), torch.float32), TensorSpec((), torch.int64))
    bad_shape = D.from_generator(lambda: iter([([1, 2], 1), ([1, 2, 3], 2)]), output_signature=sig)
    with pytest.raises(ValueError, match=r"element 1 has a leaf of shape \(3,\)"):
        list(bad_shape)
    bad_structure = D.from_generator(lambda: iter([1]), output_signature=sig)
    with pytest.raises(ValueError, match="element 0 has structure int"):
        list(bad_structure)
    old = D.from_generator(lambda: iter([(1, [2.0])]), (torch.int32, torch.float64), ((), (1,)))
    (x,) = list(old)
    assert x[0].dtype == torch.int32 and x[1].dtype == torch.float64
    assert old.element_spec == (TensorSpec((), torch.int32), TensorSpec((1,), torch.float64))
    assert list(D.from_generator(lambda a, b: iter(range(a, b)), args=(2, 5))) == [2, 3, 4]


def test_reduction_errors():
    with pytest.raises(ValueError, match="empty"):
        D.range(0).get_single_element()
    with pytest.raises(ValueError, match="more than one"):
        D.range(2).get_single_element()
    with pytest.raises(ValueError, match="infinite"):
        D.range(2).repeat().reduce(0, lambda s, x: s + x)
    with pytest.raises(ValueError, match="same structure"):
        D.range(3).reduce((0, 0), lambda s, x: s[0])
    with pytest.raises(ValueError, match="new_state, output_element"):
        list(D.range(3).scan(0, lambda s, x: s))
    with pytest.raises(TypeError, match="integers or strings"):
        list(D.from_tensor_slices([0.5, 1.5]).unique())
    assert list(D.from_tensor_slices(torch.tensor([2, 2, 1])).unique()) == [
        torch.tensor(2), torch.tensor(1)]


def test_window_and_group_errors():
    with pytest.raises(ValueError, match="size, shift and stride must be >= 1"):
        D.range(3).window(0)
    with pytest.raises(ValueError, match="exactly one of window_size and window_size_func"):
        D.range(3).group_by_window(lambda x: x, lambda k, w: w)
    with pytest.raises(TypeError, match="must return a Dataset"):
        list(D.range(3).group_by_window(lambda x: 0, lambda k, w: 5, window_size=1))
    with pytest.raises(ValueError, match="bucket_batch_sizes"):
        D.range(3).bucket_by_sequence_length(len, [2], [1])
    with pytest.raises(ValueError, match="pad_to_bucket_boundary"):
        list(D.range(1, 5).map(torch.ones).bucket_by_sequence_length(
            len, [2], [1, 1], pad_to_bucket_boundary=True))


def test_mixture_errors():
    with pytest.raises(ValueError, match="2 weights for 3 datasets"):
        D.sample_from_datasets([D.range(1)] * 3, [0.5, 0.5])
    with pytest.raises(ValueError, match="selector index 2 is out of range for 2 datasets"):
        list(D.choose_from_datasets([D.range(2), D.range(2)], D.from_tensor_slices([0, 2])))
    with pytest.raises(ValueError, match="probability vector"):
        D.range(3).rejection_resample(lambda x: 0, [0.5, 0.6])


def test_ragged_values():
    r = Ragged.from_rows([torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64),
                          torch.tensor([3])])
    assert r.row_splits.tolist() == [0, 2, 2, 3] and r.to_list() == [[1, 2], [], [3]]
    assert r.to_tensor(-1).tolist() == [[1, 2], [-1, -1], [3, -1]]
    assert r.to_sparse().to_dense().tolist() == [[1, 2], [0, 0], [3, 0]]
    assert [x.tolist() for x in D.from_tensors(r).unbatch()] == [[1, 2], [], [3]]
    with pytest.raises(ValueError, match="one ragged dimension"):
        Ragged.from_rows([torch.zeros(1, 2), torch.zeros(1, 3)])


def test_compressed_tfrecords_are_standard_streams(tmp_path):
    records = [b"a", b"", b"xyz" * 50]
    for kind, opener in (("GZIP", lambda p: gzip.open(p).read()),
                         ("ZLIB", lambda p: zlib.decompress(open(p, "rb").read()))):
        path = str(tmp_path / f"r.{kind}")
        with TFRecordWriter(path, TFRecordOptions(kind)) as w:
            for r in records:
                w.write(r)
        assert list(TFRecordDataset(path, compression_type=kind)) == records
        plain = str(tmp_path / "plain")
        with open(plain, "wb") as fh:
            fh.write(opener(path))
        assert list(TFRecordDataset(plain)) == records
    with pytest.raises(ValueError, match="compression_type 'LZ4'"):
        TFRecordDataset(path, compression_type="LZ4")
    text = str(tmp_path / "t.gz")
    with gzip.open(text, "wt") as fh:
        fh.write("one\ntwo\n")
    assert list(TextLineDataset(text, compression_type="GZIP")) == ["one", "two"]


def test_example_parse_errors():
    rec = encode_example({"a": [1, 2], "s": ["x"]})
    with pytest.raises(ExampleParseError, match="Feature: b .* is required"):
        parse_single_example(rec, {"b": FixedLenFeature([], torch.int64)})
    with pytest.raises(ExampleParseError, match="Key: a, Index: 0. Number of values"):
        parse_single_example(rec, {"a": FixedLenFeature([3], torch.int64)})
    with pytest.raises(ExampleParseError, match="Data type: int64 but expected type: float"):
        parse_single_example(rec, {"a": VarLenFeature(torch.float32)})
    with pytest.raises(ValueError, match="int64, float32 or string"):
        FixedLenFeature([], torch.int32)
    with pytest.raises(TypeError, match="'S' dtype"):
        parse_example(np.asarray([rec]), {"a": VarLenFeature(torch.int64)})
    with pytest.raises(ExampleParseError, match="truncated"):
        parse_single_example(rec[:-3], {"a": VarLenFeature(torch.int64)})


def test_csv_errors(tmp_path):
    path = str(tmp_path / "x.csv")
    with open(path, "w") as fh:
        fh.write("1,2\n,3\n4\n")
    with pytest.raises(CsvParseError, match="record 1, field 0 is required"):
        list(CsvDataset(path, [torch.int32, 0]))
    with pytest.raises(CsvParseError, match="record 2: expected 2 fields but got 1"):
        list(CsvDataset(path, [0, 0]))
    with pytest.raises(CsvParseError, match="'a' is not a valid float32"):
        with open(path, "w") as fh:
            fh.write("a\n")
        list(CsvDataset(path, [0.0]))
    with pytest.raises(ValueError, match="select_cols must be increasing"):
        CsvDataset(path, [0, 0], select_cols=[1, 0])


def test_save_is_atomic_and_load_names_what_is_missing(tmp_path):
    def boom(x):
        if x == 3:
            raise RuntimeError("boom")
        return x

    with pytest.raises(Exception, match="boom"):
        D.range(5).map(boom).save(str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="not a saved dataset"):
        D.load(str(tmp_path / "out"))
    D.range(3).save(str(tmp_path / "out"), compression="ZLIB")
    assert list(D.load(str(tmp_path / "out"))) == [0, 1, 2]
    with pytest.raises(ValueError, match="saved with compression 'ZLIB'"):
        D.load(str(tmp_path / "out"), compression="GZIP")


def test_data_sharding_refuses_unseeded_mixtures():
    o = Options()
    o.distribute.auto_shard_policy = AutoShardPolicy.DATA
    unseeded = D.sample_from_datasets([D.range(4), D.range(10, 14)]).with_options(o)
    with pytest.raises(ValueError, match="unseeded DirectedInterleaveDataset"):
        auto_shard(unseeded, 2, 0)
    for target in ([0.9, 0.1], [1.0, 0.0]):  # a mixture; a filter alone
        with pytest.raises(ValueError, match="unseeded"):
            auto_shard(D.range(8).rejection_resample(lambda x: x % 2, target, [0.5, 0.5])
                       .with_options(o), 2, 0)
    same = D.range(8).rejection_resample(lambda x: x % 2, [0.5, 0.5], [0.5, 0.5])
    assert list(auto_shard(same.with_options(o), 2, 1)) == [(1, 1), (1, 3), (1, 5), (1, 7)]
    seeded = D.sample_from_datasets([D.range(4), D.range(10, 14)], seed=3).with_options(o)
    both = sorted(list(auto_shard(seeded, 2, 0)) + list(auto_shard(seeded, 2, 1)))
    assert both == [0, 1, 2, 3, 10, 11, 12, 13]


def test_from_generator_ragged_signature():
    from stratagem.data import RaggedSpec

    def gen():
        for i in range(4):
            yield [[7] * j for j in range(i)], i

    sig = (RaggedSpec((None, None), torch.int32), TensorSpec((), torch.int64))
    ds = D.from_generator(gen, output_signature=sig)
    out = list(ds)
    assert [r.to_list() for r, _ in out] == [[], [[]], [[], [7]], [[], [7], [7, 7]]]
    assert all(r.values.dtype == torch.int32 for r, _ in out)
    assert ds.element_spec == sig


def _inverse(x):
    if x == 0:  # tf: tf.debugging.check_numerics(1.0 / x, ...) (elements are tensors: 1/0 is inf)
        raise ZeroDivisionError("division by zero")
    return 1.0 / x


@pytest.mark.parametrize("parallel", [None, 2])
def test_ignore_errors_drops_failing_elements(parallel):
    ds = D.from_tensor_slices([1.0, 2.0, 0.0, 4.0, 0.0, 5.0]).map(
        _inverse, num_parallel_calls=parallel).map(lambda x: x * 2).ignore_errors()
    assert list(ds) == [2.0, 1.0, 0.5, 0.4]  # tf.data: the same with check_numerics
    assert ds.cardinality() == UNKNOWN_CARDINALITY
    from stratagem.data import assert_resumes_exactly

    assert_resumes_exactly(lambda: D.from_tensor_slices([1.0, 0.0, 4.0, 0.0, 5.0]).map(
        _inverse, num_parallel_calls=parallel).ignore_errors(), range(5))


def test_ignore_errors_skips_bad_records_and_csv_rows(tmp_path):
    path = str(tmp_path / "r.tfrecord")
    with TFRecordWriter(path) as w:
        for r in (b"one", b"two", b"three"):
            w.write(r)
    raw = bytearray(open(path, "rb").read())
    raw[12 + 19] ^= 0xFF  # a data byte of the second record (records at 0, 19, 38)
    open(path, "wb").write(bytes(raw))
    assert list(TFRecordDataset(path).ignore_errors()) == [b"one", b"three"]
    open(path, "wb").write(bytes(raw[:45]))  # the third record is cut short
    assert list(TFRecordDataset([path, path]).ignore_errors()) == [b"one", b"one"]
    csv = tmp_path / "c.csv"
    csv.write_text("a,b\n1,2\nx,3\n4,5\n6\n")
    from stratagem.data import make_csv_dataset

    ds = make_csv_dataset(str(csv), 10, shuffle=False, num_epochs=1, ignore_errors=True,
                          column_defaults=[0, 0])
    (batch,) = list(ds)
    assert batch["a"].tolist() == [1, 4] and batch["b"].tolist() == [2, 5]
