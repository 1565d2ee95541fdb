"""Differential suite: stratagem against tf.data outputs stored by scripts/make_tf_reference.py
(no TensorFlow needed). Each case is rebuilt with stratagem from the stored parameters and
compared element for element (or, where tf.data draws random numbers, by its contract)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch

from stratagem.data import Dataset as D
from stratagem.data.csv import CsvDataset, decode_csv, make_csv_dataset
from stratagem.data.example import (
    FixedLenFeature,
    FixedLenSequenceFeature,
    VarLenFeature,
    parse_example,
    parse_single_example,
)
from stratagem.data.fixed_length import FixedLengthRecordDataset
from stratagem.data.options import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from stratagem.data.ragged import Ragged
from stratagem.data.spec import RaggedSpec, TensorSpec
from stratagem.data.tfrecord import TFRecordDataset

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_reference")
with open(os.path.join(DIR, "reference.json")) as _fh:
    CASES: dict[str, list[dict[str, Any]]] = json.load(_fh)["cases"]


def cases(entry: str) -> list[dict[str, Any]]:
    return CASES[entry]


def ids(entry: str) -> list[str]:
    return [json.dumps(c["params"])[:60] for c in CASES[entry]]


def _array(dtype: str, arr: np.ndarray) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(arr.shape), "values": arr.reshape(-1).tolist()}


def _text(values: list[Any], shape: list[int]) -> dict[str, Any]:
    return {"dtype": "string", "shape": shape,
            "values": [(v.encode() if isinstance(v, str) else bytes(v)).hex() for v in values]}


def plain(x: Any) -> Any:
    """stratagem values in the reference's JSON form (Python int -> int64, float -> float32,
    str -> utf-8 bytes, as tf.data converts them)."""
    if isinstance(x, Ragged):
        return {"ragged": {"values": plain(x.values), "row_splits": plain(x.row_splits)}}
    if isinstance(x, torch.Tensor):
        return _array(str(x.dtype).replace("torch.", ""), x.numpy())
    if isinstance(x, np.ndarray | np.generic):
        arr = np.asarray(x)
        if arr.dtype.kind in "OSU":
            return _text(list(arr.reshape(-1)), list(arr.shape))
        return _array(arr.dtype.name, arr)
    if isinstance(x, tuple):
        return {"tuple": [plain(v) for v in x]}
    if isinstance(x, dict):
        return {"dict": {str(k): plain(v) for k, v in sorted(x.items())}}
    if isinstance(x, list):
        return [plain(v) for v in x]
    if isinstance(x, str | bytes):
        return _text([x], [])
    if isinstance(x, bool):
        return _array("bool", np.asarray(x))
    if isinstance(x, int):
        return _array("int64", np.asarray(x, dtype=np.int64))
    if isinstance(x, float):
        return _array("float32", np.asarray(x, dtype=np.float32))
    raise TypeError(type(x))


def run(ds: Any) -> list[Any]:
    with ds.iterator(epoch=0, seed=0) as it:
        return [plain(e) for e in it]


def spec_plain(spec: Any) -> Any:
    if isinstance(spec, tuple):
        return {"tuple": [spec_plain(s) for s in spec]}
    if isinstance(spec, dict):
        return {"dict": {k: spec_plain(v) for k, v in sorted(spec.items())}}
    assert isinstance(spec, TensorSpec | RaggedSpec)
    dtype = spec.dtype if isinstance(spec.dtype, str) else str(spec.dtype).replace("torch.", "")
    kind = "ragged" if isinstance(spec, RaggedSpec) else "tensor"
    return {"kind": kind, "shape": list(spec.shape), "dtype": dtype}


def sparse_plain(rows: list[Any]) -> dict[str, Any]:
    """tf's SparseTensor of a batched VarLenFeature, from its rows."""
    indices = [[i, j] for i, r in enumerate(rows) for j in range(len(r))]
    width = max((len(r) for r in rows), default=0)
    values: list[Any] = [v for r in rows for v in (r.tolist() if hasattr(r, "tolist") else r)]
    return {"indices": _array("int64", np.asarray(indices, dtype=np.int64).reshape(-1, 2)),
            "values": values, "dense_shape": _array("int64", np.asarray([len(rows), width]))}


def sequences(lengths: list[int]) -> D:
    """Element i is [i + 1] * lengths[i] (int64), as the reference script builds them."""
    return D.from_tensor_slices(lengths).enumerate().map(
        lambda i, n: torch.full((int(n),), int(i) + 1, dtype=torch.int64))


# -- windows and groups ------------------------------------------------------------------

@pytest.mark.parametrize("case", cases("window"), ids=ids("window"))
def test_window(case):
    n, size, shift, stride, drop = case["params"]
    windows = D.range(n).window(size, shift, stride, drop)
    assert run(windows.flat_map(lambda w: w.batch(size))) == case["output"]
    assert windows.cardinality() == case["cardinality"]


def test_window_of_tuples():
    (case,) = cases("window_tuple")
    n, size, shift = case["params"]
    ds = D.zip((D.range(n), D.range(n).map(lambda x: x * 10))).window(size, shift).flat_map(
        lambda a, b: D.zip((a.batch(size), b.batch(size))))
    assert run(ds) == case["output"]


@pytest.mark.parametrize("case", cases("group_by_window"), ids=ids("group_by_window"))
def test_group_by_window(case):
    n, mod, size, size_func = case["params"]
    if size_func is None:
        ds = D.range(n).group_by_window(lambda x: x % mod, lambda k, w: w.batch(size),
                                        window_size=size)
    else:
        ds = D.range(n).group_by_window(lambda x: x % mod, lambda k, w: w.batch(10),
                                        window_size_func=lambda k: k + 1)
    assert run(ds) == case["output"]


@pytest.mark.parametrize("case", cases("bucket_by_sequence_length"),
                         ids=ids("bucket_by_sequence_length"))
def test_bucket_by_sequence_length(case):
    lengths, bounds, sizes, pad_b, no_pad, drop, padded = case["params"]
    kwargs: dict[str, Any] = {}
    if padded is not None:
        kwargs = {"padded_shapes": [padded[0]], "padding_values": padded[1]}
    ds = sequences(lengths).bucket_by_sequence_length(
        len, bounds, sizes, pad_to_bucket_boundary=pad_b, no_padding=no_pad,
        drop_remainder=drop, **kwargs)
    assert run(ds) == case["output"]


@pytest.mark.parametrize("case", cases("ragged_batch"), ids=ids("ragged_batch"))
def test_ragged_batch(case):
    lengths, bs, drop = case["params"]
    assert run(sequences(lengths).ragged_batch(bs, drop)) == case["output"]


def test_ragged_batch_keeps_scalars_dense():
    (case,) = cases("ragged_batch_tuple")
    lengths, bs = case["params"]
    assert run(sequences(lengths).enumerate().ragged_batch(bs)) == case["output"]


# -- mixtures ------------------------------------------------------------------------------

def _sources(sizes: list[int]) -> list[D]:
    return [D.range(i * 100, i * 100 + s) for i, s in enumerate(sizes)]


@pytest.mark.parametrize("case", cases("choose_from_datasets"), ids=ids("choose_from_datasets"))
def test_choose_from_datasets(case):
    sizes, choices, stop = case["params"]
    choice = D.from_tensor_slices(np.asarray(choices, dtype=np.int64))
    ds = D.choose_from_datasets(_sources(sizes), choice, stop_on_empty_dataset=stop)
    assert run(ds) == case["output"]


@pytest.mark.parametrize("case", cases("sample_from_datasets"), ids=ids("sample_from_datasets"))
def test_sample_from_datasets_contract(case):
    """tf.data's draws come from its own RNG, so the comparison is by contract: the same
    elements (all of them unless stop_on_empty_dataset), each source in its own order, the
    exact output where the weights leave no choice, and the same output for the same seed."""
    sizes, weights, seed, stop = case["params"]
    ds = D.sample_from_datasets(_sources(sizes), weights, seed=seed, stop_on_empty_dataset=stop)
    got = [v["values"][0] for v in run(ds)]
    want = [v["values"][0] for v in case["output"]]
    for i, size in enumerate(sizes):
        mine = [x for x in got if i * 100 <= x < i * 100 + size]
        assert mine == list(range(i * 100, i * 100 + len(mine))), "each source keeps its order"
    if not stop:
        assert sorted(got) == sorted(want)
    else:
        ran_out = [i for i, size in enumerate(sizes)
                   if i * 100 + size - 1 in got]
        assert ran_out and len(got) < sum(sizes)
    if weights is not None and sorted(weights)[-1] == 1.0 or len(sizes) == 1:
        assert got == want
    assert run(ds) == run(D.sample_from_datasets(_sources(sizes), weights, seed=seed,
                                                 stop_on_empty_dataset=stop))


def _class_func(k: int):
    if k == 2:
        return lambda x: int(x % 4 >= 3)
    return lambda x: x % 10 % k


@pytest.mark.parametrize("case", cases("rejection_resample"), ids=ids("rejection_resample"))
@pytest.mark.slow
def test_rejection_resample_contract(case):
    """Different random draws than tf.data: compare how many elements come out and the class
    distribution with tf.data's, and check every pair is (class_func(x), x)."""
    n, k, target, initial, seed = case["params"]
    cls = _class_func(k)
    ds = D.range(n).rejection_resample(cls, target, initial, seed=seed)
    out = list(ds.iterator(epoch=0, seed=0))
    assert all(c == cls(x) for c, x in out)
    counts = np.bincount([c for c, _ in out], minlength=k)
    assert abs(len(out) - case["count"]) <= 0.08 * case["count"]
    tf_frac = np.asarray(case["class_counts"]) / case["count"]
    assert np.abs(counts / len(out) - tf_frac).max() < 0.05
    assert out == list(D.range(n).rejection_resample(cls, target, initial, seed=seed)
                       .iterator(epoch=0, seed=0)), "deterministic under a seed"


# -- generators and specs ----------------------------------------------------------------

GENERATORS = {
    "int32 scalars": (lambda: (i for i in range(5)), TensorSpec((), torch.int32)),
    "float pairs": (lambda: ([i, i / 2] for i in range(4)), TensorSpec((2,), torch.float32)),
    "tuple": (lambda: ((i, [i] * 3) for i in range(3)),
              (TensorSpec((), torch.int64), TensorSpec((3,), torch.float64))),
    "dict var len": (lambda: ({"a": list(range(i)), "s": f"s{i}"} for i in range(4)),
                     {"a": TensorSpec((None,), torch.int64), "s": TensorSpec((), "string")}),
    "matrix": (lambda: (np.full((2, 2), i, np.int16) for i in range(3)),
               TensorSpec((2, None), torch.int16)),
}


@pytest.mark.parametrize("case", cases("from_generator"), ids=ids("from_generator"))
def test_from_generator_output_signature(case):
    gen, sig = GENERATORS[case["params"][0]]
    ds = D.from_generator(gen, output_signature=sig)
    assert run(ds) == case["output"]
    assert spec_plain(ds.element_spec) == case["element_spec"]


SPECS = {
    "range": lambda: D.range(3),
    "slices dict": lambda: D.from_tensor_slices(
        {"x": np.asarray([[1.0, 2.0]], np.float32), "s": ["a"]}),
    "batch": lambda: D.range(5).batch(2),
    "batch drop": lambda: D.range(5).batch(2, drop_remainder=True),
    "zip enumerate": lambda: D.zip(
        (D.range(3), D.from_tensor_slices(np.asarray([[1, 2], [3, 4], [5, 6]], np.int32)))
    ).enumerate(),
    "tensors": lambda: D.from_tensors(torch.zeros((2, 3), dtype=torch.float64)),
}


@pytest.mark.parametrize("case", cases("element_spec"), ids=ids("element_spec"))
def test_element_spec(case):
    assert spec_plain(SPECS[case["params"][0]]().element_spec) == case["output"]


# -- reductions and stateful transforms ---------------------------------------------------

@pytest.mark.parametrize("case", cases("reduce"), ids=ids("reduce"))
def test_reduce(case):
    n, kind = case["params"]
    if kind == "sum":
        got = D.range(n).reduce(0, lambda s, x: s + x)
    else:
        got = D.range(n).reduce((0, 0), lambda s, x: (s[0] + 1, s[1] + x))
    assert plain(got) == case["output"]


@pytest.mark.parametrize("case", cases("scan"), ids=ids("scan"))
def test_scan(case):
    n, kind = case["params"]
    if kind == "cumsum":
        ds = D.range(n).scan(0, lambda s, x: (s + x, s + x))
    elif kind == "fib":
        ds = D.range(n).scan((0, 1), lambda s, x: ((s[1], s[0] + s[1]), s[0]))
    else:
        ds = D.range(n).scan(1, lambda s, x: (s * 2, (x, s)))
    assert run(ds) == case["output"]


@pytest.mark.parametrize("case", cases("take_while"), ids=ids("take_while"))
def test_take_while(case):
    n, k = case["params"]
    assert run(D.range(n).take_while(lambda x: x < k)) == case["output"]


@pytest.mark.parametrize("case", cases("unique"), ids=ids("unique"))
def test_unique(case):
    (values,) = case["params"]
    # the reference script gives tf.constant(values, tf.int64) (a Python int list is int32)
    values = values if values and isinstance(values[0], str) else np.asarray(values, np.int64)
    assert run(D.from_tensor_slices(values).unique()) == case["output"]


SINGLES = {
    "int": lambda: D.from_tensors(np.int64(7)),  # as the reference script (Python 7: int32)
    "tuple": lambda: D.from_tensors((np.int64(1), np.float32(2.5))),
    "dict": lambda: D.from_tensors({"a": np.int64(3)}),
    "vector": lambda: D.range(4).batch(4),
    "string": lambda: D.from_tensors("hi"),
}


@pytest.mark.parametrize("case", cases("get_single_element"), ids=ids("get_single_element"))
def test_get_single_element(case):
    assert plain(SINGLES[case["params"][0]]().get_single_element()) == case["output"]


@pytest.mark.parametrize("case", cases("rebatch"), ids=ids("rebatch"))
def test_rebatch(case):
    n, b, sizes, drop = case["params"]
    assert run(D.range(n).batch(b).rebatch(sizes, drop)) == case["output"]


@pytest.mark.parametrize("case", cases("sparse_batch"), ids=ids("sparse_batch"))
def test_sparse_batch(case):
    lengths, bs, row = case["params"]
    ds = D.from_tensor_slices(lengths).map(
        lambda k: torch.full((k,), k * 10 - 5, dtype=torch.int64)).sparse_batch(bs, row)
    got = [{"sparse": {"indices": plain(s.indices().T.contiguous()), "values": plain(s.values()),
                       "dense_shape": plain(torch.tensor(list(s.shape)))}} for s in ds]
    assert got == case["output"]


def _inverse(x):
    if x == 0:
        raise ZeroDivisionError("1/0")
    return 1.0 / x


@pytest.mark.parametrize("parallel", [None, 2])
@pytest.mark.parametrize("case", cases("ignore_errors"), ids=ids("ignore_errors"))
def test_ignore_errors(case, parallel):
    (values,) = case["params"]
    ds = D.from_tensor_slices(np.asarray(values, np.float32)).map(
        _inverse, num_parallel_calls=parallel).ignore_errors()
    assert run(ds) == case["output"]


CARDINALITIES = {
    "range": lambda: D.range(42),
    "repeat": lambda: D.range(42).repeat(),
    "repeat take": lambda: D.range(42).repeat().take(5),
    "filter": lambda: D.range(42).filter(lambda x: True),
    "batch": lambda: D.range(10).batch(3),
    "window": lambda: D.range(10).window(3),
    "take_while": lambda: D.range(10).take_while(lambda x: x < 3),
    "unique": lambda: D.range(10).unique(),
    "scan": lambda: D.range(10).scan(0, lambda s, x: (s, x)),
    "ragged_batch": lambda: D.range(10).ragged_batch(4),
    "sample infinite": lambda: D.sample_from_datasets([D.range(3).repeat(), D.range(3)]),
    "sample finite": lambda: D.sample_from_datasets([D.range(3), D.range(4)]),
    "group_by_window": lambda: D.range(10).group_by_window(lambda x: x % 2, lambda k, w: w, 2),
    "filter infinite": lambda: D.range(3).repeat().filter(lambda y: y > 0),
    "take_while infinite": lambda: D.range(3).repeat().take_while(lambda z: z < 5),
    "unique infinite": lambda: D.range(3).repeat().unique(),
    "window infinite": lambda: D.range(3).repeat().window(2),
    "group_by_window infinite": lambda: D.range(3).repeat().group_by_window(
        lambda a: a % 2, lambda k, w: w, 2),
    "choose finite selector": lambda: D.choose_from_datasets([D.range(3).repeat()] * 2,
                                                             D.range(2)),
    "rejection_resample infinite": lambda: D.range(3).repeat().rejection_resample(
        lambda b: b % 2, [0.5, 0.5]),
    "scan infinite": lambda: D.range(3).repeat().scan(0, lambda s, c: (s, c)),
    "ragged_batch infinite": lambda: D.range(3).repeat().ragged_batch(2),
    "filter repeat": lambda: D.range(3).filter(lambda d: d > 0).repeat(),
    "filter repeat 2": lambda: D.range(3).filter(lambda e: e > 1).repeat(2),
    "empty repeat": lambda: D.range(0).repeat(),
    "zip infinite unknown": lambda: D.zip((D.range(3).repeat(), D.range(2).filter(lambda f: f))),
    "concatenate unknown infinite": lambda: D.range(2).filter(lambda g: g > 0).concatenate(
        D.range(3).repeat()),
    "unbatch infinite": lambda: D.range(3).batch(2).repeat().unbatch(),
    "flat_map infinite": lambda: D.range(3).repeat().flat_map(lambda h: D.range(2)),
}


def test_cardinality_against_tf():
    (case,) = cases("cardinality")
    assert [CARDINALITIES[name]().cardinality() for name in case["params"]] == case["output"]
    (constants,) = cases("cardinality_constants")
    assert [INFINITE_CARDINALITY, UNKNOWN_CARDINALITY] == constants["output"]


# -- materialised datasets ------------------------------------------------------------------

@pytest.mark.parametrize("case", cases("snapshot_save_load"), ids=ids("snapshot_save_load"))
def test_snapshot_save_load(case, tmp_path):
    n, comp = case["params"]
    src = D.range(n).map(lambda x: (x * x, str(int(x))))  # tf: tf.strings.as_string(x)
    snap = src.snapshot(str(tmp_path / "snap"), compression=comp or "AUTO")
    assert run(snap) == case["output"]
    assert len(os.listdir(tmp_path / "snap")) == 1, "the first complete pass was written"
    assert run(snap) == case["output"], "the second pass reads the snapshot"
    src.save(str(tmp_path / "saved"), compression=comp)
    loaded = D.load(str(tmp_path / "saved"))
    assert run(loaded) == case["output"]
    assert loaded.cardinality() == n


# -- records ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", cases("tfrecord"), ids=ids("tfrecord"))
def test_tfrecord_written_by_tensorflow(case):
    import hashlib

    names, comp = case["params"]
    records = list(TFRecordDataset([os.path.join(DIR, n) for n in names], compression_type=comp))
    assert [[len(r), hashlib.sha256(r).hexdigest()[:16]] for r in records] == case["output"]


SPEC = {
    "id": FixedLenFeature([2], torch.int64),
    "label": FixedLenFeature([], "string"),
    "score": FixedLenFeature([], torch.float32, default_value=-1.0),
    "tag": FixedLenFeature([], "string", default_value="none"),
    "tokens": VarLenFeature(torch.int64),
    "words": VarLenFeature("string"),
    "frames": FixedLenSequenceFeature([2], torch.float32, allow_missing=True),
}


EXAMPLE_SPECS = {
    "full": SPEC,
    "varlen only": {k: SPEC[k] for k in ("tokens", "words")},
    "fixed with defaults": {k: SPEC[k] for k in ("id", "label", "score", "tag")},
    "sequence default": {"frames": FixedLenSequenceFeature([2], torch.float32, allow_missing=True,
                                                           default_value=-1.0)},
}


def _as_tf(parsed: dict[str, Any], batched: bool) -> dict[str, Any]:
    """Our parse result in tf's form (VarLenFeature as a SparseTensor)."""
    out = {}
    for name, value in parsed.items():
        if isinstance(SPEC[name], VarLenFeature):
            rows = value.rows() if batched else [value]
            sparse = sparse_plain(rows)
            flat = value.values if batched else value
            sparse["values"] = plain(flat if isinstance(flat, torch.Tensor) else np.asarray(
                list(flat), dtype=object).reshape(-1))
            if not batched:
                sparse["indices"] = plain(torch.arange(len(value)).reshape(-1, 1))
                sparse["dense_shape"] = plain(torch.tensor([len(value)]))
            out[name] = {"sparse": sparse}
        else:
            out[name] = plain(value)
    return {"dict": dict(sorted(out.items()))}


@pytest.mark.parametrize("case", cases("parse_example"), ids=ids("parse_example"))
def test_parse_example_matches_tf_io_parse_example(case):
    fname, batch, spec_name = case["params"]
    records = list(TFRecordDataset(os.path.join(DIR, fname), compression_type="GZIP"))
    got = [_as_tf(parse_example(records[i:i + batch], EXAMPLE_SPECS[spec_name]), True)
           for i in range(0, len(records), batch)]
    assert got == case["output"]
    batched = TFRecordDataset(os.path.join(DIR, fname), compression_type="GZIP").batch(batch)
    assert [_as_tf(parse_example(b, EXAMPLE_SPECS[spec_name]), True) for b in batched] == got


def test_parse_single_example_matches_tf():
    (case,) = cases("parse_single_example")
    spec = {k: v for k, v in SPEC.items() if k != "frames"}
    records = list(TFRecordDataset(os.path.join(DIR, case["params"][0]), compression_type="GZIP"))
    assert [_as_tf(parse_single_example(r, spec), False) for r in records] == case["output"]


@pytest.mark.parametrize("case", cases("FixedLengthRecordDataset"),
                         ids=ids("FixedLengthRecordDataset"))
def test_fixed_length_records(case):
    fname, rec, head, foot, comp = case["params"]
    ds = FixedLengthRecordDataset(os.path.join(DIR, fname), rec, head, foot, compression_type=comp)
    assert [r.hex() for r in ds] == case["output"]


# -- CSV --------------------------------------------------------------------------------------

DECODE_DEFAULTS = [[[0], [""], [1.5]], [[torch.tensor(0)]], [["z"], [-1]], [[0.0], [0]],
                   [[""], [""]]]


@pytest.mark.parametrize("case,defaults", list(zip(cases("decode_csv"), DECODE_DEFAULTS)),
                         ids=ids("decode_csv"))
def test_decode_csv(case, defaults):
    records, delim, select = case["params"]
    got = decode_csv(records, defaults, field_delim=delim, select_cols=select)
    assert [plain(c) for c in got] == case["output"]

CSV_FILES = [os.path.join(DIR, "a.csv"), os.path.join(DIR, "b.csv")]
CSV_CASES = {
    "all typed": ([torch.int32, "", 0.0, [torch.tensor(-1)], ""], None, None, "NA"),
    "select": ([torch.int64, -9.0], [0, 2], None, "NA"),
    "exclude": ([0, [0.0], "?"], None, [1, 3], "NA"),
    "na default": ([0, "", [-7.0], [torch.tensor(0)], "none"], None, None, "NA"),
    "strings": (["", ""], [1, 4], None, ""),
}


@pytest.mark.parametrize("case", cases("CsvDataset"), ids=ids("CsvDataset"))
def test_csv_dataset(case):
    defaults, select, exclude, na = CSV_CASES[case["params"][0]]
    ds = CsvDataset(CSV_FILES, defaults, header=True, select_cols=select, exclude_cols=exclude,
                    na_value=na)
    assert run(ds) == case["output"]


MAKE_CSV = {
    "infer": {"batch_size": 3},
    "label": {"batch_size": 2, "label_name": "count"},
    "select": {"batch_size": 4, "select_columns": ["score", "id"]},
    "defaults": {"batch_size": 5, "column_defaults": [0, "", 0.0, [torch.tensor(0)], ""]},
    "few rows inference": {"batch_size": 7, "num_rows_for_inference": 2,
                           "select_columns": ["id", "score"]},
}


@pytest.mark.parametrize("case", cases("make_csv_dataset"), ids=ids("make_csv_dataset"))
def test_make_csv_dataset(case):
    ds = make_csv_dataset(CSV_FILES, shuffle=False, num_epochs=1, na_value="NA",
                          **MAKE_CSV[case["params"][0]])
    assert run(ds) == case["output"]
