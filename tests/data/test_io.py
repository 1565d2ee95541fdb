"""TFRecord format, TextLineDataset, and the atomically committed file cache."""

import os
import struct

import numpy as np
import pytest
import torch

from stratagem.data import (
    CorruptRecordError,
    Dataset,
    TextLineDataset,
    TFRecordDataset,
    TFRecordWriter,
    crc32c,
    masked_crc32c,
)


@pytest.mark.timeout(10)
def test_crc32c_known_vectors():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros


@pytest.mark.timeout(10)
def test_tfrecord_round_trip_and_layout(tmp_path):
    path = str(tmp_path / "a.tfrecord")
    records = [b"hello", b"", bytes(range(256)) * 3]
    with TFRecordWriter(path) as w:
        for r in records:
            w.write(r)
    raw = open(path, "rb").read()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length == 5
    assert struct.unpack("<I", raw[8:12])[0] == masked_crc32c(raw[:8])
    assert raw[12:17] == b"hello"
    assert struct.unpack("<I", raw[17:21])[0] == masked_crc32c(b"hello")
    assert list(TFRecordDataset(path)) == records
    assert list(TFRecordDataset([path, path])) == records * 2


@pytest.mark.timeout(10)
def test_tfrecord_corruption_names_file_and_offset(tmp_path):
    path = str(tmp_path / "bad.tfrecord")
    with TFRecordWriter(path) as w:
        w.write(b"first")
        w.write(b"second")
    raw = bytearray(open(path, "rb").read())
    raw[21 + 12] ^= 0xFF  # flip a data byte of the second record (offset 21)
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CorruptRecordError, match=r"bad\.tfrecord.*offset 21"):
        list(TFRecordDataset(path))
    open(path, "wb").write(bytes(raw[:25]))
    with pytest.raises(CorruptRecordError, match="truncated"):
        list(TFRecordDataset(path))


@pytest.mark.timeout(10)
def test_text_lines(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("x\ny\n")
    b.write_text("z\r\nw")
    assert list(TextLineDataset([str(a), str(b)])) == ["x", "y", "z", "w"]
    assert list(TextLineDataset(str(a), encoding=None)) == [b"x", b"y"]


@pytest.mark.timeout(20)
def test_file_cache_commits_atomically(tmp_path):
    calls = []

    def record(x):
        calls.append(x)
        return {"t": torch.tensor([x, x]), "n": np.float32(x) * 2, "s": f"e{x}", "i": x}

    cache = str(tmp_path / "cache")
    ds = Dataset.range(5).map(record).cache(cache)
    it = iter(ds)
    next(it), next(it)
    it.close()
    assert os.listdir(tmp_path) == [], "a partly read epoch leaves no cache file (nor temp)"
    first = list(ds)
    assert os.path.exists(cache) and len(calls) == 7
    second = list(ds)
    assert len(calls) == 7, "the second epoch reads the cache"
    for a, b in zip(first, second):
        assert torch.equal(a["t"], b["t"]) and a["s"] == b["s"] and a["i"] == b["i"]
        assert a["n"] == b["n"]
    assert np.load(cache, allow_pickle=False) is not None  # readable with pickle disabled


@pytest.mark.timeout(10)
def test_memory_cache_second_epoch(tmp_path):
    calls = []
    ds = Dataset.range(4).map(lambda x: calls.append(x) or x).cache()
    assert list(ds) == list(ds) == [0, 1, 2, 3]
    assert len(calls) == 4
