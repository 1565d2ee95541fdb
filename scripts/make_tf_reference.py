"""Dev-only: write tf.data reference outputs for tests/data/test_tfdata_*.py.

Needs TensorFlow, in a throwaway venv (never the project's):
    python3 -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install tensorflow-cpu numpy
    /tmp/tfenv/bin/python scripts/make_tf_reference.py

Writes tests/data/tf_reference/: reference.json (every case's parameters and tf.data's output),
TFRecord files written by TensorFlow (plain, GZIP, ZLIB; Examples in GZIP) and CSV inputs.
The tests rebuild each case with stratagem from the same parameters and compare.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import tensorflow as tf

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "tf_reference")


def plain(x):
    """tf values as JSON: arrays keep dtype and shape; bytes as hex; ragged as splits."""
    if isinstance(x, tf.RaggedTensor):
        return {"ragged": {"values": plain(x.flat_values), "row_splits": plain(x.row_splits)}}
    if isinstance(x, tf.SparseTensor):
        return {"sparse": {"indices": plain(x.indices), "values": plain(x.values),
                           "dense_shape": plain(x.dense_shape)}}
    if isinstance(x, tf.Tensor):
        x = x.numpy()
    if isinstance(x, np.ndarray | np.generic):
        arr = np.asarray(x)
        if arr.dtype.kind in "OS":
            return {"dtype": "string", "shape": list(arr.shape),
                    "values": [bytes(v).hex() for v in arr.reshape(-1)]}
        return {"dtype": arr.dtype.name, "shape": list(arr.shape),
                "values": arr.reshape(-1).tolist()}
    if isinstance(x, tuple):
        return {"tuple": [plain(v) for v in x]}
    if isinstance(x, dict):
        return {"dict": {str(k): plain(v) for k, v in sorted(x.items())}}
    if isinstance(x, list):
        return [plain(v) for v in x]
    if isinstance(x, bytes):
        return {"dtype": "string", "shape": [], "values": [x.hex()]}
    if isinstance(x, bool | int | float):
        return x
    raise TypeError(type(x))


def spec_plain(spec):
    if isinstance(spec, tuple):
        return {"tuple": [spec_plain(s) for s in spec]}
    if isinstance(spec, dict):
        return {"dict": {k: spec_plain(v) for k, v in sorted(spec.items())}}
    kind = "ragged" if isinstance(spec, tf.RaggedTensorSpec) else "tensor"
    return {"kind": kind, "shape": spec.shape.as_list(), "dtype": spec.dtype.name}


def run(ds):
    return [plain(e) for e in ds]


D = tf.data.Dataset
REF: dict[str, list] = {}


def case(entry, params, output, **extra):
    REF.setdefault(entry, []).append({"params": params, "output": output, **extra})


def sequences(lengths):
    return D.from_tensor_slices(tf.constant(lengths, tf.int64)).enumerate().map(
        lambda i, n: tf.fill([n], i + 1))


def main():
    # window --------------------------------------------------------------------------
    for n, size, shift, stride, drop in [(7, 3, 2, 1, False), (10, 3, 1, 2, True),
                                         (10, 3, 1, 2, False), (5, 2, None, 1, False),
                                         (12, 4, 3, 2, False), (0, 2, 1, 1, False),
                                         (9, 3, 5, 1, True), (11, 4, 4, 1, True)]:
        ds = D.range(n).window(size, shift, stride, drop).flat_map(lambda w, s=size: w.batch(s))
        case("window", [n, size, shift, stride, drop], run(ds),
             cardinality=int(D.range(n).window(size, shift, stride, drop).cardinality()))
    ds = D.zip((D.range(7), D.range(7).map(lambda x: x * 10))).window(3, 2).flat_map(
        lambda a, b: D.zip((a.batch(3), b.batch(3))))
    case("window_tuple", [7, 3, 2], run(ds))

    # group_by_window -------------------------------------------------------------------
    for n, mod, size in [(10, 3, 2), (10, 3, 4), (17, 4, 3), (5, 1, 10), (20, 5, 1), (0, 2, 2)]:
        ds = D.range(n).group_by_window(lambda x, m=mod: x % m,
                                        lambda k, w, s=size: w.batch(s), window_size=size)
        case("group_by_window", [n, mod, size, None], run(ds))
    for n, mod in [(12, 3), (15, 4)]:
        ds = D.range(n).group_by_window(lambda x, m=mod: x % m, lambda k, w: w.batch(10),
                                        window_size_func=lambda k: k + 1)
        case("group_by_window", [n, mod, None, "k+1"], run(ds))

    # bucket_by_sequence_length ---------------------------------------------------------
    lens = [1, 3, 5, 2, 7, 4, 4, 6, 1, 8, 2, 3, 5, 9]
    for bounds, sizes, pad_b, drop in [([3, 6], [2, 2, 2], False, False),
                                       ([3, 6], [2, 3, 2], False, True),
                                       ([4, 8, 10], [3, 2, 2, 1], True, False),
                                       ([5], [4, 2], False, False),
                                       ([2, 4, 6, 8], [1, 2, 3, 2, 1], False, False),
                                       ([5, 10], [3, 3, 3], True, True)]:
        ds = sequences(lens).bucket_by_sequence_length(
            lambda x: tf.shape(x)[0], bounds, sizes, pad_to_bucket_boundary=pad_b,
            drop_remainder=drop)
        case("bucket_by_sequence_length", [lens, bounds, sizes, pad_b, False, drop, None],
             run(ds))
    same = [2, 2, 5, 5, 2, 5, 5, 2, 2]
    ds = sequences(same).bucket_by_sequence_length(lambda x: tf.shape(x)[0], [3], [2, 3],
                                                   no_padding=True)
    case("bucket_by_sequence_length", [same, [3], [2, 3], False, True, False, None], run(ds))
    ds = sequences(lens).bucket_by_sequence_length(lambda x: tf.shape(x)[0], [4, 8], [2, 2, 2],
                                                   padded_shapes=[10], padding_values=tf.constant(-1, tf.int64))
    case("bucket_by_sequence_length", [lens, [4, 8], [2, 2, 2], False, False, False, [10, -1]],
         run(ds))

    # ragged_batch ----------------------------------------------------------------------
    for lengths, bs, drop in [([1, 3, 0, 2, 5], 2, False), ([1, 3, 0, 2, 5], 2, True),
                              ([4, 4, 4], 3, False), ([2, 1, 3, 1, 2, 6, 1], 3, False),
                              ([0, 0, 1], 1, False), ([3], 5, False)]:
        case("ragged_batch", [lengths, bs, drop], run(sequences(lengths).ragged_batch(bs, drop)))
    ds = sequences([1, 3, 0, 2]).enumerate().ragged_batch(3)
    case("ragged_batch_tuple", [[1, 3, 0, 2], 3], run(ds))

    # choose_from_datasets / sample_from_datasets ----------------------------------------
    for sizes, choices, stop in [([3, 3], [0, 1, 1, 0, 0, 1], True),
                                 ([2, 4], [0, 0, 0, 1, 1, 0, 1], True),
                                 ([2, 4], [0, 0, 0, 1, 1, 0, 1], False),
                                 ([1, 1, 3], [2, 1, 0, 2, 1, 2, 0, 2], False),
                                 ([5, 5], [], True), ([3, 2], [1, 1, 1, 0, 1], False)]:
        datasets = [D.range(i * 100, i * 100 + s) for i, s in enumerate(sizes)]
        ds = D.choose_from_datasets(datasets, D.from_tensor_slices(tf.constant(choices, tf.int64)),
                                    stop_on_empty_dataset=stop)
        case("choose_from_datasets", [sizes, choices, stop], run(ds))
    for sizes, weights, seed, stop in [([5, 5], None, 1, False), ([10, 3], [0.7, 0.3], 2, False),
                                       ([4, 4, 4], [0.2, 0.3, 0.5], 3, False),
                                       ([6, 6], [1.0, 0.0], 4, False),
                                       ([20, 5], [0.5, 0.5], 5, True),
                                       ([8], None, 6, False)]:
        datasets = [D.range(i * 100, i * 100 + s) for i, s in enumerate(sizes)]
        ds = D.sample_from_datasets(datasets, weights, seed=seed, stop_on_empty_dataset=stop)
        case("sample_from_datasets", [sizes, weights, seed, stop], run(ds))

    # rejection_resample ------------------------------------------------------------------
    for n, k, target, initial, seed in [(3000, 2, [0.5, 0.5], None, 1),
                                        (3000, 2, [0.5, 0.5], [0.75, 0.25], 2),
                                        (3000, 3, [0.2, 0.3, 0.5], None, 3),
                                        (3000, 4, [0.25, 0.25, 0.25, 0.25], None, 4),
                                        (3000, 2, [0.9, 0.1], [0.75, 0.25], 5)]:
        # class of x: x % 4 < 3 -> 0 else 1 for k=2 (75/25); x % 10 % k otherwise
        if k == 2:
            cls = lambda x: tf.cast(x % 4 >= 3, tf.int32)  # noqa: E731
        else:
            cls = lambda x, k=k: tf.cast(x % 10 % k, tf.int32)  # noqa: E731
        ds = D.range(n).rejection_resample(cls, target, initial, seed=seed)
        out = [(int(c), int(x)) for c, x in ds.as_numpy_iterator()]
        counts = np.bincount([c for c, _ in out], minlength=k).tolist()
        case("rejection_resample", [n, k, target, initial, seed], None, count=len(out),
             class_counts=counts)

    # from_generator(output_signature) + element_spec ----------------------------------
    gens = {
        "int32 scalars": (lambda: (i for i in range(5)), tf.TensorSpec((), tf.int32)),
        "float pairs": (lambda: ([i, i / 2] for i in range(4)), tf.TensorSpec((2,), tf.float32)),
        "tuple": (lambda: ((i, [i] * 3) for i in range(3)),
                  (tf.TensorSpec((), tf.int64), tf.TensorSpec((3,), tf.float64))),
        "dict var len": (lambda: ({"a": list(range(i)), "s": f"s{i}"} for i in range(4)),
                         {"a": tf.TensorSpec((None,), tf.int64), "s": tf.TensorSpec((), tf.string)}),
        "matrix": (lambda: (np.full((2, 2), i, np.int16) for i in range(3)),
                   tf.TensorSpec((2, None), tf.int16)),
    }
    for name, (gen, sig) in gens.items():
        ds = D.from_generator(gen, output_signature=sig)
        case("from_generator", [name], run(ds), element_spec=spec_plain(ds.element_spec))

    specs = {
        "range": D.range(3),
        "slices dict": D.from_tensor_slices({"x": [[1.0, 2.0]], "s": ["a"]}),
        "batch": D.range(5).batch(2),
        "batch drop": D.range(5).batch(2, drop_remainder=True),
        "zip enumerate": D.zip((D.range(3), D.from_tensor_slices([[1, 2], [3, 4], [5, 6]]))).enumerate(),
        "tensors": D.from_tensors(tf.zeros((2, 3), tf.float64)),
    }
    for name, ds in specs.items():
        case("element_spec", [name], spec_plain(ds.element_spec))

    # reduce / scan / take_while / unique / get_single_element --------------------------
    for n in [0, 1, 5, 10, 100]:
        case("reduce", [n, "sum"], plain(D.range(n).reduce(np.int64(0), lambda s, x: s + x)))
    case("reduce", [7, "count_sum"], plain(D.range(7).reduce(
        (np.int64(0), np.int64(0)), lambda s, x: (s[0] + 1, s[1] + x))))
    for n, kind in [(0, "cumsum"), (6, "cumsum"), (10, "cumsum"), (8, "fib"), (5, "pair")]:
        if kind == "cumsum":
            ds = D.range(n).scan(np.int64(0), lambda s, x: (s + x, s + x))
        elif kind == "fib":
            ds = D.range(n).scan((np.int64(0), np.int64(1)), lambda s, x: ((s[1], s[0] + s[1]), s[0]))
        else:
            ds = D.range(n).scan(np.int64(1), lambda s, x: (s * 2, (x, s)))
        case("scan", [n, kind], run(ds))
    for n, k in [(10, 4), (10, 0), (5, 10), (0, 3), (20, 13)]:
        case("take_while", [n, k], run(D.range(n).take_while(lambda x, k=k: x < k)))
    for values in [[1, 2, 1, 3, 2, 4], [5, 5, 5], [], [3, 1, 2, 1, 3], ["a", "b", "a", "c"]]:
        ds = D.from_tensor_slices(tf.constant(values, tf.string if values and isinstance(
            values[0], str) else tf.int64))
        case("unique", [values], run(ds.unique()))
    singles = {"int": D.from_tensors(np.int64(7)), "tuple": D.from_tensors((np.int64(1), np.float32(2.5))),
               "dict": D.from_tensors({"a": np.int64(3)}), "vector": D.range(4).batch(4),
               "string": D.from_tensors("hi")}
    for name, ds in singles.items():
        case("get_single_element", [name], plain(ds.get_single_element()))

    # rebatch ---------------------------------------------------------------------------------
    for n, b, sizes, drop in [(6, 2, 3, False), (7, 4, 3, False), (7, 2, [2, 1, 1], False),
                              (10, 3, [4, 1], True), (9, 5, 2, True), (5, 5, [1, 3], False)]:
        case("rebatch", [n, b, sizes, drop], run(D.range(n).batch(b).rebatch(sizes, drop)))

    # sparse_batch ----------------------------------------------------------------------------
    for lengths, bs, row in [([1, 0, 3, 2], 2, [4]), ([1, 0, 3, 2], 3, [5]), ([2, 2, 2], 2, [2]),
                             ([0, 0], 1, [3]), ([4, 1, 2, 3, 1], 4, [6])]:
        ds = D.from_tensor_slices(tf.constant(lengths, tf.int64)).map(
            lambda k: tf.fill([k], k * 10 - 5)).sparse_batch(bs, row)
        case("sparse_batch", [lengths, bs, row], run(ds))

    # ignore_errors: 1/x fails (check_numerics) where x == 0 --------------------------------
    for values in [[1.0, 2.0, 0.0, 4.0], [0.0, 0.0], [0.0, 1.0, 0.0, 2.0, 0.0], [3.0], [],
                   [5.0, 0.0, 0.0, 0.5]]:
        ds = D.from_tensor_slices(tf.constant(values, tf.float32)).map(
            lambda v: tf.debugging.check_numerics(1.0 / v, "inf")).ignore_errors()
        case("ignore_errors", [values], run(ds))

    # cardinality -------------------------------------------------------------------------
    cards = {
        "range": D.range(42), "repeat": D.range(42).repeat(), "repeat take": D.range(42).repeat().take(5),
        "filter": D.range(42).filter(lambda x: True), "batch": D.range(10).batch(3),
        "window": D.range(10).window(3), "take_while": D.range(10).take_while(lambda x: x < 3),
        "unique": D.range(10).unique(), "scan": D.range(10).scan(np.int64(0), lambda s, x: (s, x)),
        "ragged_batch": D.range(10).ragged_batch(4),
        "sample infinite": D.sample_from_datasets([D.range(3).repeat(), D.range(3)]),
        "sample finite": D.sample_from_datasets([D.range(3), D.range(4)]),
        "group_by_window": D.range(10).group_by_window(lambda x: x % 2, lambda k, w: w, 2),
        "filter infinite": D.range(3).repeat().filter(lambda y: y > 0),
        "take_while infinite": D.range(3).repeat().take_while(lambda z: z < 5),
        "unique infinite": D.range(3).repeat().unique(),
        "window infinite": D.range(3).repeat().window(2),
        "group_by_window infinite": D.range(3).repeat().group_by_window(lambda a: a % 2,
                                                                        lambda k, w: w, 2),
        "choose finite selector": D.choose_from_datasets([D.range(3).repeat()] * 2, D.range(2)),
        "rejection_resample infinite": D.range(3).repeat().rejection_resample(
            lambda b: tf.cast(b % 2, tf.int32), [0.5, 0.5]),
        "scan infinite": D.range(3).repeat().scan(np.int64(0), lambda s, c: (s, c)),
        "ragged_batch infinite": D.range(3).repeat().ragged_batch(2),
        "filter repeat": D.range(3).filter(lambda d: d > 0).repeat(),
        "filter repeat 2": D.range(3).filter(lambda e: e > 1).repeat(2),
        "empty repeat": D.range(0).repeat(),
        "zip infinite unknown": D.zip((D.range(3).repeat(), D.range(2).filter(lambda f: f > 0))),
        "concatenate unknown infinite": D.range(2).filter(lambda g: g > 0).concatenate(
            D.range(3).repeat()),
        "unbatch infinite": D.range(3).batch(2).repeat().unbatch(),
        "flat_map infinite": D.range(3).repeat().flat_map(lambda h: D.range(2)),
    }
    case("cardinality", list(cards), [int(ds.cardinality()) for ds in cards.values()])
    case("cardinality_constants", [], [int(tf.data.INFINITE_CARDINALITY),
                                       int(tf.data.UNKNOWN_CARDINALITY)])

    # snapshot / save+load round trips ----------------------------------------------------
    import tempfile

    for n, comp in [(0, None), (1, "GZIP"), (7, None), (20, "GZIP"), (33, None)]:
        tmp = tempfile.mkdtemp()
        src = D.range(n).map(lambda x: (x * x, tf.strings.as_string(x)))
        snap = src.snapshot(os.path.join(tmp, "snap"), compression=comp or "AUTO")
        first = run(snap)
        src.save(os.path.join(tmp, "saved"), compression=comp)
        loaded = run(D.load(os.path.join(tmp, "saved"), compression=comp))
        assert first == run(snap) == loaded
        case("snapshot_save_load", [n, comp], first)

    # TFRecord files written by TensorFlow -------------------------------------------------
    rng = np.random.default_rng(0)
    records = [bytes(rng.integers(0, 256, int(k), dtype=np.uint8)) for k in
               [0, 1, 5, 17, 60, 3, 99, 0, 42, 8]]
    more = [bytes([i % 7]) * (i * 13 % 50) for i in range(25)]
    big = [bytes(range(256)) * 80, b"tail", bytes(3000)]
    files = {"records.tfrecord": ("", records), "records.tfrecord.gz": ("GZIP", records),
             "records.tfrecord.zlib": ("ZLIB", records), "empty.tfrecord.gz": ("GZIP", []),
             "more.tfrecord.gz": ("GZIP", more), "big.tfrecord.zlib": ("ZLIB", big)}
    for fname, (comp, recs) in files.items():
        with tf.io.TFRecordWriter(os.path.join(OUT, fname), options=comp) as w:
            for r in recs:
                w.write(r)
    import hashlib

    for names, comp in [(["records.tfrecord"], ""), (["records.tfrecord.gz"], "GZIP"),
                        (["records.tfrecord.zlib"], "ZLIB"), (["empty.tfrecord.gz"], "GZIP"),
                        (["records.tfrecord.gz", "empty.tfrecord.gz", "more.tfrecord.gz"], "GZIP"),
                        (["big.tfrecord.zlib"], "ZLIB"),
                        (["big.tfrecord.zlib", "records.tfrecord.zlib"], "ZLIB")]:
        ds = tf.data.TFRecordDataset([os.path.join(OUT, n) for n in names], compression_type=comp)
        got = [bytes(r) for r in ds.as_numpy_iterator()]
        assert got == [r for n in names for r in files[n][1]]
        case("tfrecord", [names, comp], [[len(r), hashlib.sha256(r).hexdigest()[:16]]
                                          for r in got])

    # FixedLengthRecordDataset ---------------------------------------------------------------
    body = bytes(range(30))
    with open(os.path.join(OUT, "fixed.bin"), "wb") as fh:
        fh.write(body)
    import gzip

    with open(os.path.join(OUT, "fixed.bin.gz"), "wb") as raw, gzip.GzipFile(
            fileobj=raw, mode="wb", mtime=0) as fh:
        fh.write(body)
    for fname, rec, head, foot, comp in [("fixed.bin", 3, 0, 0, ""), ("fixed.bin", 4, 2, 0, ""),
                                         ("fixed.bin", 5, 3, 2, ""), ("fixed.bin", 1, 10, 10, ""),
                                         ("fixed.bin.gz", 7, 2, 0, "GZIP"),
                                         ("fixed.bin.gz", 5, 0, 5, "GZIP")]:
        ds = tf.data.FixedLengthRecordDataset(os.path.join(OUT, fname), rec, head, foot,
                                              compression_type=comp)
        case("FixedLengthRecordDataset", [fname, rec, head, foot, comp],
             [bytes(r).hex() for r in ds.as_numpy_iterator()])

    # decode_csv ----------------------------------------------------------------------------
    for records, defaults, select in [
        (["1,a,2.5", "3,b,"], [[0], [""], [1.5]], None),
        (["7"], [[tf.constant(0, tf.int64)]], None),
        (['"x,y",2', '"q""r",', ",5"], [["z"], [-1]], None),
        (["1,2,3,4", "5,6,7,8"], [[0.0], [0]], [1, 3]),
        (["a;b", "c;d"], [[""], [""]], None),
    ]:
        delim = ";" if ";" in records[0] else ","
        out = tf.io.decode_csv(records, defaults, field_delim=delim, select_cols=select)
        case("decode_csv", [records, delim, select], [plain(c) for c in out])

    # tf.train.Example in GZIP TFRecord + tf.io.parse_example outputs -----------------------
    def feature(v):
        if isinstance(v, list) and v and isinstance(v[0], bytes):
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=v))
        if isinstance(v, list) and v and isinstance(v[0], float):
            return tf.train.Feature(float_list=tf.train.FloatList(value=v))
        return tf.train.Feature(int64_list=tf.train.Int64List(value=v))

    examples = []
    for i in range(12):
        f = {"id": feature([i, -i * 1000003]), "label": feature([b"cls%d" % (i % 3)]),
             "tokens": feature([j * 7 - 3 for j in range(i % 4)] or []),
             "words": feature([b"w%d" % j for j in range(i % 3)] + ([b"z\x00"] if i == 5 else []))
             if i % 3 else tf.train.Feature(bytes_list=tf.train.BytesList()),
             "frames": feature([float(i) + j / 4 for j in range(2 * (i % 3))]) if i % 3 else
             tf.train.Feature(float_list=tf.train.FloatList())}
        if i % 4 != 1:
            f["score"] = feature([i / 3.0])
        if i % 5 == 0:
            f["tag"] = feature([b"t%d" % i])
        examples.append(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
    path = os.path.join(OUT, "examples.tfrecord.gz")
    with tf.io.TFRecordWriter(path, options="GZIP") as w:
        for e in examples:
            w.write(e)
    spec = {
        "id": tf.io.FixedLenFeature([2], tf.int64),
        "label": tf.io.FixedLenFeature([], tf.string),
        "score": tf.io.FixedLenFeature([], tf.float32, default_value=-1.0),
        "tag": tf.io.FixedLenFeature([], tf.string, default_value="none"),
        "tokens": tf.io.VarLenFeature(tf.int64),
        "words": tf.io.VarLenFeature(tf.string),
        "frames": tf.io.FixedLenSequenceFeature([2], tf.float32, allow_missing=True),
    }
    specs = {
        "full": spec,
        "varlen only": {k: spec[k] for k in ("tokens", "words")},
        "fixed with defaults": {k: spec[k] for k in ("id", "label", "score", "tag")},
        "sequence default": {"frames": tf.io.FixedLenSequenceFeature(
            [2], tf.float32, allow_missing=True, default_value=-1.0)},
    }
    for spec_name, batch in [("full", 5), ("full", 1), ("full", 12), ("varlen only", 4),
                             ("fixed with defaults", 3), ("sequence default", 5)]:
        batches = [plain(tf.io.parse_example(b, specs[spec_name])) for b in
                   tf.data.TFRecordDataset(path, compression_type="GZIP").batch(batch)]
        case("parse_example", ["examples.tfrecord.gz", batch, spec_name], batches)
    singles_out = [plain(tf.io.parse_single_example(r, {k: v for k, v in spec.items()
                                                        if k != "frames"}))
                   for r in tf.data.TFRecordDataset(path, compression_type="GZIP")]
    case("parse_single_example", ["examples.tfrecord.gz"], singles_out)

    # CSV ---------------------------------------------------------------------------------
    csv_a = ('id,name,score,count,flag\n1,alpha,0.5,10,x\n2,"be,ta",1.25,,y\n3,"ga""mma",NA,30,\n'
             '4,delta,2.5,40,z\n5,"multi\nline",3.75,50,w\n')
    csv_b = 'id,name,score,count,flag\n6,eta,-1.5,60,v\n7,theta,1e3,3000000000,u\n'
    for fname, text in [("a.csv", csv_a), ("b.csv", csv_b)]:
        with open(os.path.join(OUT, fname), "w", newline="") as fh:
            fh.write(text)
    files = [os.path.join(OUT, "a.csv"), os.path.join(OUT, "b.csv")]
    csv_cases = [
        ("all typed", [tf.int32, "", 0.0, [tf.constant(-1, tf.int64)], ""], None, None, "NA"),
        ("select", [tf.int64, -9.0], [0, 2], None, "NA"),
        ("exclude", [0, [0.0], "?"], None, [1, 3], "NA"),
        ("na default", [0, "", [-7.0], [tf.constant(0, tf.int64)], "none"], None, None, "NA"),
        ("strings", ["", ""], [1, 4], None, ""),
    ]
    for name, defaults, select, exclude, na in csv_cases:
        ds = tf.data.experimental.CsvDataset(files, defaults, header=True, select_cols=select,
                                             exclude_cols=exclude, na_value=na)
        case("CsvDataset", [name], run(ds))
    make_cases = [
        ("infer", dict(batch_size=3)),
        ("label", dict(batch_size=2, label_name="count")),
        ("select", dict(batch_size=4, select_columns=["score", "id"])),
        ("defaults", dict(batch_size=5, column_defaults=[0, "", 0.0, [tf.constant(0, tf.int64)], ""])),
        ("few rows inference", dict(batch_size=7, num_rows_for_inference=2,
                                    select_columns=["id", "score"])),
    ]
    for name, kw in make_cases:
        ds = tf.data.experimental.make_csv_dataset(files, shuffle=False, num_epochs=1,
                                                   na_value="NA", **kw)
        case("make_csv_dataset", [name], run(ds))

    with open(os.path.join(OUT, "reference.json"), "w") as fh:
        json.dump({"tensorflow": tf.__version__, "cases": REF}, fh, separators=(",", ":"))
    print("wrote", OUT, {k: len(v) for k, v in REF.items()}, file=sys.stderr)


if __name__ == "__main__":
    main()
