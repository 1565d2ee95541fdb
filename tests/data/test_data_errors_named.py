"""Issue 13 (data layer): cache temp files are cleaned up, and corrupt caches, corrupt
TFRecord files and mismatched iterator states raise errors that name what was received and
what to do."""

from __future__ import annotations

import gc
import os
import struct

import numpy as np
import pytest

from stratagem.data import Dataset, TFRecordDataset, TFRecordWriter
from stratagem.data.tfrecord import CorruptRecordError, masked_crc32c


def _tmp_files(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if ".tmp-" in f)


def _fail_on_3(x: int) -> int:
    if x == 3:
        raise RuntimeError("boom")
    return x


# -- 1. cache(filename) removes its own temporary file -----------------------------------


def test_cache_temp_removed_on_close(tmp_path):
    path = str(tmp_path / "c")
    it = iter(Dataset.range(10).cache(path))
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    assert len(_tmp_files(str(tmp_path))) == 1
    it.close()
    assert _tmp_files(str(tmp_path)) == []
    assert not os.path.exists(path)


def test_cache_temp_removed_on_garbage_collection(tmp_path):
    path = str(tmp_path / "c")
    it = iter(Dataset.range(10).cache(path))
    next(it)
    del it
    gc.collect()
    assert _tmp_files(str(tmp_path)) == []


def test_cache_temp_removed_on_pipeline_error(tmp_path):
    path = str(tmp_path / "c")
    ds = Dataset.range(10).map(_fail_on_3).cache(path)
    with pytest.raises(Exception, match="boom"):
        list(ds)
    assert _tmp_files(str(tmp_path)) == []
    assert not os.path.exists(path)


def test_cache_never_touches_another_writers_temp(tmp_path):
    path = str(tmp_path / "c")
    ds = Dataset.range(10).cache(path)
    a, b = iter(ds), iter(ds)
    next(a)
    next(b)
    assert len(_tmp_files(str(tmp_path))) == 2
    a.close()
    left = _tmp_files(str(tmp_path))
    assert len(left) == 1
    assert list(b) == list(range(1, 10))  # b still completes and commits its cache
    assert _tmp_files(str(tmp_path)) == []
    assert list(ds) == list(range(10))


# -- 2. a corrupt cache file names itself and what to do -----------------------------------


def _make_cache(path: str) -> Dataset:
    ds = Dataset.range(5).cache(path)
    assert list(ds) == list(range(5))
    assert os.path.exists(path)
    return Dataset.range(5).cache(path)


@pytest.mark.parametrize("damage", ["truncate", "garble", "garbage"])
def test_corrupt_cache_file_named(tmp_path, damage):
    path = str(tmp_path / "c")
    ds = _make_cache(path)
    data = open(path, "rb").read()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garble":
        data = bytes(b ^ 0x5A for b in data)
    else:
        data = b"PK\x03\x04" + os.urandom(64)
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(ValueError, match="cache file .*corrupt.*delete it") as info:
        list(ds)
    assert path in str(info.value)


def test_cache_file_without_index_named(tmp_path):
    path = str(tmp_path / "c")
    np.savez(path + ".npz", e0_0=np.arange(3))
    os.replace(path + ".npz", path)
    with pytest.raises(ValueError, match="index") as info:
        list(Dataset.range(5).cache(path))
    assert path in str(info.value) and "delete it" in str(info.value)


def test_cache_entry_garbled_named(tmp_path):
    import zipfile

    path = str(tmp_path / "c")
    _make_cache(path)
    with zipfile.ZipFile(path) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    entries["e2_0.npy"] = b"\x93NUMPY garbage"
    with zipfile.ZipFile(path, "w") as z:
        for n, v in entries.items():
            z.writestr(n, v)
    with pytest.raises(ValueError, match="element 2") as info:
        list(Dataset.range(5).cache(path))
    assert path in str(info.value) and "delete it" in str(info.value)


# -- 3. corrupt TFRecord files name the file, offset and record ----------------------------


def _write_records(path: str, n: int = 3) -> None:
    with TFRecordWriter(path) as w:
        for i in range(n):
            w.write(b"record-%d" % i)


@pytest.mark.parametrize("verify", [True, False])
def test_tfrecord_garbage_length_is_not_memory_error(tmp_path, verify):
    path = str(tmp_path / "r.tfrecord")
    _write_records(path)
    data = bytearray(open(path, "rb").read())
    # record 1 starts after record 0 (16 + 8 bytes); give it a huge length with a valid CRC
    header = struct.pack("<Q", 2**62)
    data[24:36] = header + struct.pack("<I", masked_crc32c(header))
    open(path, "wb").write(bytes(data))
    ds = TFRecordDataset(path, verify_checksums=verify)
    with pytest.raises(CorruptRecordError) as info:
        list(ds)
    msg = str(info.value)
    assert path in msg and "offset 24" in msg and "record 1" in msg
    assert "compression_type" in msg


def test_tfrecord_random_bytes_no_verify(tmp_path):
    path = str(tmp_path / "r.tfrecord")
    with open(path, "wb") as f:
        f.write(b"\xff" * 8 + b"\x00" * 20)
    with pytest.raises(ValueError, match="not a TFRecord") as info:
        list(TFRecordDataset(path, verify_checksums=False))
    assert path in str(info.value) and "offset 0" in str(info.value)


def test_tfrecord_truncated_record_named(tmp_path):
    path = str(tmp_path / "r.tfrecord")
    _write_records(path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-3])
    with pytest.raises(CorruptRecordError) as info:
        list(TFRecordDataset(path))
    msg = str(info.value)
    assert path in msg and "offset 48" in msg and "record 2" in msg


def test_tfrecord_truncated_compressed_record_named(tmp_path):
    import gzip

    path = str(tmp_path / "r.tfrecord.gz")
    _write_records(path[:-3])
    data = open(path[:-3], "rb").read()
    with gzip.open(path, "wb") as f:
        f.write(data[:-3])
    with pytest.raises(CorruptRecordError) as info:
        list(TFRecordDataset(path, compression_type="GZIP"))
    msg = str(info.value)
    assert path in msg and "record 2" in msg and "truncated" in msg


def test_tfrecord_crc_mismatch_named(tmp_path):
    path = str(tmp_path / "r.tfrecord")
    _write_records(path)
    data = bytearray(open(path, "rb").read())
    data[24 + 12] ^= 0xFF  # first data byte of record 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptRecordError) as info:
        list(TFRecordDataset(path))
    msg = str(info.value)
    assert path in msg and "offset 24" in msg and "record 1" in msg and "CRC" in msg
    # ignore_errors() still skips just the bad record
    assert list(TFRecordDataset(path).ignore_errors()) == [b"record-0", b"record-2"]


# -- 4. a state from another pipeline says so -----------------------------------------------


def test_state_from_another_pipeline_named():
    a = Dataset.range(10).shuffle(4, seed=1).batch(2)
    b = Dataset.range(10)
    it = iter(a)
    next(it)
    state = it.state_dict()
    with pytest.raises(ValueError, match="does not match this pipeline") as info:
        b.iterator_from_state(state)
    assert "state['root']" in str(info.value)
    it2 = iter(b)
    with pytest.raises(ValueError, match="does not match this pipeline"):
        it2.load_state_dict(state)


def test_state_missing_keys_named():
    it = iter(Dataset.range(3))
    state = it.state_dict()
    del state["root"]
    with pytest.raises(ValueError, match="lacks key"):
        Dataset.range(3).iterator_from_state(state)
    with pytest.raises(ValueError, match="not a stratagem.data iterator state"):
        Dataset.range(3).iterator_from_state([1, 2])  # type: ignore[arg-type]
