"""Materialised datasets on disk: Dataset.save / Dataset.load and snapshot.

A saved dataset is a directory: ``metadata.json`` (format, shard count, element count,
compression) and ``shard_NNNNN.tfrecord`` files (TFRecord framing, optionally GZIP/ZLIB),
one record per element in stratagem's element encoding (a JSON header with the structure
and the raw bytes of each tensor/array; no pickle). TensorFlow's own save format (snapshot
protos of TensorProtos) is not read or written.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stratagem.data import compression as _compression
from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.ragged import Ragged
from stratagem.data.structure import from_json, to_json

FORMAT = "stratagem.data.saved/1"
METADATA = "metadata.json"


# -- element encoding --------------------------------------------------------------------

def encode(element: Any) -> bytes:
    """One element as bytes: a 4-byte header length, a JSON header, then tensor payloads."""
    payloads: list[bytes] = []
    header = json.dumps(_encode_node(element, payloads), separators=(",", ":")).encode()
    return struct.pack("<I", len(header)) + header + b"".join(payloads)


# The recursions are module-level functions passed their state: a closure calling itself is a
# reference cycle, and would hold every element's bytes until Python's garbage collector ran.
def _encode_node(x: Any, payloads: list[bytes]) -> Any:
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return {"u": [_encode_node(v, payloads) for v in x]}
    if isinstance(x, dict):
        return {"d": [[to_json(k), _encode_node(v, payloads)] for k, v in x.items()]}
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        payloads.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return {"T": str(t.dtype).replace("torch.", ""), "s": list(t.shape)}
    if isinstance(x, np.ndarray) and x.dtype.kind in "biufc":
        payloads.append(np.ascontiguousarray(x).tobytes())
        return {"N": x.dtype.str, "s": list(x.shape)}
    if isinstance(x, Ragged):
        return {"R": _encode_node(x.values, payloads), "splits": _encode_node(x.row_splits, payloads)}
    return {"j": to_json(x)}


class _Payloads:
    """The tensor bytes after a record's header, read in order."""

    def __init__(self, record: bytes, offset: int) -> None:
        self.record, self.offset = record, offset

    def take(self, nbytes: int) -> bytes:
        out = self.record[self.offset:self.offset + nbytes]
        self.offset += nbytes
        return out


def decode(record: bytes) -> Any:
    """The inverse of :func:`encode`."""
    (n,) = struct.unpack("<I", record[:4])
    tree = json.loads(record[4:4 + n])
    return _decode_node(tree, _Payloads(record, 4 + n))


def _decode_node(node: dict[str, Any], payloads: _Payloads) -> Any:
    if "u" in node:
        return tuple(_decode_node(v, payloads) for v in node["u"])
    if "d" in node:
        return {from_json(k): _decode_node(v, payloads) for k, v in node["d"]}
    if "T" in node:
        dtype = getattr(torch, node["T"])
        count = int(np.prod(node["s"], dtype=np.int64))
        size = torch.empty((), dtype=dtype).element_size() * count
        raw = bytearray(payloads.take(size))
        flat = (torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if size
                else torch.empty(0, dtype=dtype))
        return flat.reshape(node["s"])
    if "N" in node:
        dtype = np.dtype(node["N"])
        count = int(np.prod(node["s"], dtype=np.int64))
        return np.frombuffer(payloads.take(dtype.itemsize * count), dtype=dtype).reshape(node["s"]).copy()
    if "R" in node:
        return Ragged(_decode_node(node["R"], payloads), _decode_node(node["splits"], payloads))
    return from_json(node["j"])


# -- save / load -------------------------------------------------------------------------

def _shard_name(i: int) -> str:
    return f"shard_{i:05d}.tfrecord"


class ShardWriter:
    """Writes elements into the shard files of ``directory`` (which must exist); ``finish``
    writes the metadata."""

    def __init__(
        self, directory: str, kind: str, shard_func: Callable[..., Any] | None
    ) -> None:
        self.directory, self.kind, self.shard_func = directory, kind, shard_func
        self.writers: dict[int, Any] = {}
        self.count = 0

    def write(self, x: Any) -> None:
        from stratagem.data.tfrecord import TFRecordWriter

        shard = 0
        if self.shard_func is not None:
            value = self.shard_func(*x) if isinstance(x, tuple) else self.shard_func(x)
            shard = int(value.item() if hasattr(value, "item") else value)
            if shard < 0:
                raise ValueError(f"save: shard_func returned {shard}; shards are >= 0")
        if shard not in self.writers:
            self.writers[shard] = TFRecordWriter(
                os.path.join(self.directory, _shard_name(shard)), self.kind
            )
        self.writers[shard].write(encode(x))
        self.count += 1

    def close(self) -> None:
        for w in self.writers.values():
            w.close()

    def finish(self) -> None:
        self.close()
        meta = {"format": FORMAT, "shards": sorted(self.writers), "cardinality": self.count,
                "compression": self.kind}
        with open(os.path.join(self.directory, METADATA), "w") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())


def save(
    dataset: Dataset,
    path: str,
    compression: str | None = None,
    shard_func: Callable[..., Any] | None = None,
    checkpoint_args: Any = None,
) -> None:
    """Write every element of ``dataset`` (one epoch) under the directory ``path``.

    ``shard_func(element) -> int`` spreads elements over shard files (default: one shard,
    which keeps the order). The directory appears complete or not at all (written beside it,
    then renamed); an existing one is replaced.
    """
    if checkpoint_args is not None:
        raise TypeError(
            "save: checkpoint_args (tf.train.CheckpointManager settings) is not supported; a "
            "save is written in one pass and appears atomically"
        )
    kind = _compression.normalize(compression, "save")
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".saving-", dir=parent)
    try:
        writer = ShardWriter(tmp, kind, shard_func)
        try:
            with dataset.iterator(epoch=0) as it:
                for x in it:
                    writer.write(x)
        finally:
            writer.close()
        writer.finish()
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_metadata(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, METADATA)
    try:
        with open(meta_path) as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"load: {path!r} is not a saved dataset (no {METADATA}); write one with "
            "Dataset.save(path)"
        ) from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"load: {meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _identity(x: Dataset) -> Dataset:
    return x


def saved_dataset(
    path: str, meta: dict[str, Any], reader_func: Callable[[Dataset], Dataset] | None
) -> Dataset:
    """The dataset of a saved directory: shard datasets, read one after the other (or by
    ``reader_func(dataset_of_shard_datasets)``)."""
    from stratagem.data.tfrecord import TFRecordDataset
    from stratagem.data.transforms import AssertCardinalityDataset, MapDataset
    from stratagem.data.windowing import ListDataset

    shards = [
        MapDataset(TFRecordDataset(os.path.join(path, _shard_name(i)), meta["compression"]),
                   decode)
        for i in meta["shards"]
    ]
    if reader_func is None:
        return AssertCardinalityDataset(ListDataset(shards).flat_map(_identity),
                                        int(meta["cardinality"]))
    out = reader_func(ListDataset(shards))
    if not isinstance(out, Dataset):
        raise TypeError(f"load: reader_func must return a Dataset, got {type(out).__name__}")
    return out


def load(
    path: str,
    element_spec: Any = None,
    compression: str | None = None,
    reader_func: Callable[[Dataset], Dataset] | None = None,
) -> Dataset:
    """The dataset :func:`save` wrote to ``path`` (its compression is read from the metadata;
    ``element_spec`` is accepted for tf parity and checked against the first element's)."""
    path = os.fspath(path)
    meta = read_metadata(path)
    if compression is not None and _compression.normalize(compression, "load") != meta[
            "compression"]:
        raise ValueError(
            f"load: {path!r} was saved with compression {meta['compression']!r}, not "
            f"{compression!r}"
        )
    ds = saved_dataset(path, meta, reader_func)
    if element_spec is not None:
        ds = _WithSpec(ds, element_spec)
    return ds


class _WithSpec(Dataset):
    def __init__(self, input_ds: Dataset, spec: Any) -> None:
        self._inputs = (input_ds,)
        self._given = spec

    def _spec(self) -> Any:
        return self._given

    def _cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return self._inputs[0]._make_iterator(ctx.child(0))


# -- snapshot ----------------------------------------------------------------------------

def _feed(h: Any, x: Any, seen: set[int]) -> None:
    """Hash what defines a plan node: its type, simple fields, functions' code, data."""
    if isinstance(x, Dataset):
        if id(x) in seen:
            return
        seen.add(id(x))
        h.update(type(x).__qualname__.encode())
        for k in sorted(vars(x)):
            if k in ("_epochs_started",):
                continue
            h.update(k.encode())
            _feed(h, vars(x)[k], seen)
    elif isinstance(x, tuple | list):
        h.update(b"[")
        for v in x:
            _feed(h, v, seen)
        h.update(b"]")
    elif isinstance(x, dict):
        for k in sorted(x, key=repr):
            h.update(repr(k).encode())
            _feed(h, x[k], seen)
    elif isinstance(x, torch.Tensor):
        h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, np.ndarray):
        h.update(x.tobytes() if x.dtype != object else repr(x.tolist()).encode())
    elif callable(x) and not isinstance(x, type):
        try:
            h.update(inspect.getsource(x).encode())
        except (OSError, TypeError):
            code = getattr(x, "__code__", None)
            h.update(code.co_code if code is not None else repr(type(x)).encode())
        for v in getattr(x, "__dict__", {}).values():
            _feed(h, v, seen)
    elif x is None or isinstance(x, int | float | str | bytes | bool | range):
        h.update(repr(x).encode())
    else:
        h.update(type(x).__qualname__.encode())


def fingerprint(dataset: Dataset) -> str:
    """A hash of the plan (node types, parameters, functions' source, in-memory data)."""
    h = hashlib.sha256()
    _feed(h, dataset, set())
    return h.hexdigest()[:16]


class SnapshotDataset(Dataset):
    """``snapshot(path)``: the first complete pass writes the input's elements under
    ``path/<plan fingerprint>``; later passes (also in later runs) read them instead.

    The fingerprint covers the plan (node types, parameters, the source of its functions), so
    a changed pipeline writes a new snapshot. A pass resumed from a state in the middle of
    writing reads the input without writing (like cache()).
    """

    def __init__(
        self,
        input_ds: Dataset,
        path: str,
        compression: str | None,
        reader_func: Callable[[Dataset], Dataset] | None,
        shard_func: Callable[..., Any] | None,
    ) -> None:
        self._inputs = (input_ds,)
        self._path = os.fspath(path)
        self._compression = "GZIP" if compression in (None, "AUTO") else _compression.normalize(
            compression, "snapshot")
        self._reader_func, self._shard_func = reader_func, shard_func

    def _cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _spec(self) -> Any:
        from stratagem.data.spec import static_spec

        return static_spec(self._inputs[0])

    def directory(self) -> str:
        return os.path.join(self._path, fingerprint(self._inputs[0]))

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _SnapshotIterator(self, ctx)


class _SnapshotIterator(StatefulIterator):
    def __init__(self, ds: SnapshotDataset, ctx: Context) -> None:
        self.ds, self.ctx = ds, ctx
        self.dir = ds.directory()
        self.mode = "read" if os.path.exists(os.path.join(self.dir, METADATA)) else "write"
        self.writer: ShardWriter | None = None
        self.children = [self._make()]

    def _make(self) -> StatefulIterator:
        if self.mode == "read":
            meta = read_metadata(self.dir)
            source = saved_dataset(self.dir, meta, self.ds._reader_func)
            return source._make_iterator(self.ctx.child(1))
        return self.ds._inputs[0]._make_iterator(self.ctx.child(0))

    def __next__(self) -> Any:
        if self.mode == "write" and self.writer is None:
            os.makedirs(self.ds._path, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".snapshot-", dir=self.ds._path)
            self.writer = ShardWriter(tmp, self.ds._compression, self.ds._shard_func)
        try:
            x = next(self.children[0])
        except StopIteration:
            self._commit()
            raise
        if self.writer is not None:
            self.writer.write(x)
        return x

    def _commit(self) -> None:
        writer, self.writer = self.writer, None
        if writer is None:
            return
        self.mode = "pass"
        try:
            writer.finish()
            if os.path.exists(self.dir):
                shutil.rmtree(writer.directory)  # another writer finished first
            else:
                os.replace(writer.directory, self.dir)
        except BaseException:
            shutil.rmtree(writer.directory, ignore_errors=True)
            raise

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:  # an unfinished pass leaves nothing behind
            writer.close()
            shutil.rmtree(writer.directory, ignore_errors=True)
        super().close()

    def state_dict(self) -> dict[str, Any]:
        mode = "read" if self.mode == "read" else "pass"
        return {"mode": mode, "input": self.children[0].state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mode = state["mode"]
        if mode == "read" and self.mode != "read":
            raise ValueError(
                f"snapshot: the state was saved while reading {self.dir}, which no longer exists"
            )
        self.children[0].close()
        self.mode = mode  # a pass resumed in the middle of writing does not write
        self.children = [self._make()]
        self.children[0].load_state_dict(state["input"])
