"""tf.train.Example records without TensorFlow: a protobuf wire-format decoder (and encoder)
and parse_example / parse_single_example driven by a feature spec.

The Example message is small (Features -> map<string, Feature>; Feature is one of BytesList,
FloatList, Int64List), so it is decoded here directly from the wire format (varints,
length-delimited fields, packed and unpacked repeated values) instead of adding a dependency
on ``protobuf``: no generated code, no version skew with the user's protobuf, and numeric
lists decode with numpy in one step.

Results: ``FixedLenFeature`` -> a tensor of ``shape`` (int64/float32), or a numpy object
array of ``bytes`` for strings; ``FixedLenSequenceFeature`` -> ``[n, *shape]`` (padded with the
default to the longest in a batch); ``VarLenFeature`` -> a 1-D tensor per example, and a
:class:`~stratagem.data.ragged.Ragged` for a batch (tf's SparseTensor is ``.to_sparse()``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from stratagem.data.ragged import Ragged
from stratagem.data.spec import STRING, as_dtype


class ExampleParseError(ValueError):
    """A record is not a valid tf.train.Example, or does not fit the feature spec."""


# -- wire format ---------------------------------------------------------------------------

def _varint(buf: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if i >= len(buf):
            raise ExampleParseError("truncated varint in a serialized Example")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
        if shift >= 70:
            raise ExampleParseError("varint longer than 10 bytes in a serialized Example")


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of a message: ints for varint/fixed, bytes for
    length-delimited."""
    out: list[tuple[int, int, Any]] = []
    i, n = 0, len(buf)
    value: Any
    while i < n:
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            length, i = _varint(buf, i)
            value, i = buf[i:i + length], i + length
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ExampleParseError(f"unsupported wire type {wire} in a serialized Example")
        if i > n:
            raise ExampleParseError("truncated field in a serialized Example")
        out.append((field, wire, value))
    return out


def _packed_varints(buf: bytes) -> list[int] | np.ndarray:
    """The values of a packed varint list (a numpy uint64 array for long lists)."""
    if len(buf) > 24:
        return _packed_varints_np(buf)
    out, i = [], 0
    while i < len(buf):
        v, i = _varint(buf, i)
        out.append(v)
    return out


def _packed_varints_np(buf: bytes) -> np.ndarray:
    """Vectorized varint decoding: a value ends at each byte below 0x80; its bytes carry 7
    bits each, least significant first (bits past 64 drop, as in two's complement)."""
    b = np.frombuffer(buf, dtype=np.uint8)
    ends = np.flatnonzero(b < 0x80)
    if len(ends) == 0 or ends[-1] != len(b) - 1:
        raise ExampleParseError("truncated varint in a serialized Example")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > 10:
        raise ExampleParseError("varint longer than 10 bytes in a serialized Example")
    shift = (np.arange(len(b)) - np.repeat(starts, lengths)) * 7
    parts = (b & 0x7F).astype(np.uint64) << shift.astype(np.uint64)
    return np.bitwise_or.reduceat(parts, starts)


def _wire(wire: int, allowed: tuple[int, ...], what: str) -> None:
    """A known field of another wire type is a corrupt record (a bytes value read as an int,
    or an int as bytes, would be a wrong value without a word)."""
    if wire not in allowed:
        raise ExampleParseError(f"{what} has wire type {wire} in a serialized Example (expected {allowed})")


def _decode_feature(buf: bytes) -> tuple[str, Any]:
    """("bytes"|"float"|"int64"|"none", values) of a Feature message."""
    for field, wire, body in _fields(buf):
        if field in (1, 2, 3):
            _wire(wire, (2,), "a Feature's list")
        if field == 1:
            out = []
            for f, w, v in _fields(body):
                if f == 1:
                    _wire(w, (2,), "a BytesList value")
                    out.append(bytes(v))
            return "bytes", out
        if field == 2:
            # packed (wire type 2) or one fixed32 (wire type 5) per value: the same bytes
            parts = []
            for f, w, v in _fields(body):
                if f != 1:
                    continue
                _wire(w, (2, 5), "a FloatList value")
                if len(v) % 4:
                    raise ExampleParseError(f"a packed FloatList of {len(v)} bytes (not 4 per float) in a serialized Example")
                parts.append(np.frombuffer(v, dtype="<f4"))
            return "float", np.concatenate(parts) if parts else np.zeros(0, np.float32)
        if field == 3:
            chunks: list[Any] = []
            for f, w, v in _fields(body):
                if f != 1:
                    continue
                _wire(w, (0, 2), "an Int64List value")
                chunks.append(np.asarray(_packed_varints(v) if w == 2 else [v], dtype=np.uint64))
            arr = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint64)
            return "int64", arr.view(np.int64)
    return "none", []


def decode_example(serialized: bytes) -> dict[str, tuple[str, Any]]:
    """A serialized tf.train.Example as {name: (kind, values)}."""
    if not isinstance(serialized, bytes | bytearray | memoryview):
        raise TypeError(f"a serialized Example is bytes, got {type(serialized).__name__}")
    out: dict[str, tuple[str, Any]] = {}
    for field, wire, features in _fields(bytes(serialized)):
        if field != 1 or wire != 2:
            continue
        for f, w, entry in _fields(features):
            if f != 1 or w != 2:
                continue
            name, value = "", b""
            for ef, ew, ev in _fields(entry):
                if ef == 1:
                    _wire(ew, (2,), "a feature's name")
                    try:
                        name = ev.decode("utf-8")
                    except UnicodeDecodeError:
                        raise ExampleParseError(
                            f"a feature name in a serialized Example is not UTF-8 text: {ev[:40]!r}"
                        ) from None
                elif ef == 2:
                    _wire(ew, (2,), "a feature's value")
                    value = ev
            out[name] = _decode_feature(value)
    return out


def _key(field: int, wire: int) -> bytes:
    return _encode_varint(field << 3 | wire)


def _encode_varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _delimited(field: int, body: bytes) -> bytes:
    return _key(field, 2) + _encode_varint(len(body)) + body


def encode_example(features: Mapping[str, Any]) -> bytes:
    """A serialized tf.train.Example of {name: values}: bytes/str values become a BytesList,
    floats a FloatList, ints an Int64List (lists, arrays or tensors; packed, as TF writes).
    An empty Python list sets no list (it parses as missing: empty for VarLenFeature, the
    default for FixedLenFeature); pass an empty typed array for an empty typed list."""
    entries = []
    for name in sorted(features):
        value = features[name]
        if isinstance(value, torch.Tensor):
            value = value.numpy()
        arr = np.asarray(value, dtype=object if _is_text(value) else None).reshape(-1)
        if isinstance(value, list | tuple) and not value:
            body = b""  # an empty Python list has no type: a Feature with no list set
        elif arr.dtype == object or arr.dtype.kind in "SU":
            items = [v.encode() if isinstance(v, str) else bytes(v) for v in arr]
            body = _delimited(1, b"".join(_delimited(1, v) for v in items))
        elif arr.dtype.kind == "f":
            packed = arr.astype("<f4").tobytes()
            body = _delimited(2, _delimited(1, packed) if len(arr) else b"")
        elif arr.dtype.kind in "biu":
            packed = b"".join(_encode_varint(int(v)) for v in arr)
            body = _delimited(3, _delimited(1, packed) if len(arr) else b"")
        else:
            raise TypeError(f"encode_example: cannot encode {name!r} of dtype {arr.dtype}")
        entry = _delimited(1, name.encode()) + _delimited(2, body)
        entries.append(_delimited(1, entry))
    return _delimited(1, b"".join(entries))


def _is_text(value: Any) -> bool:
    if isinstance(value, str | bytes):
        return True
    if isinstance(value, list | tuple) and value:
        return isinstance(value[0], str | bytes)
    return isinstance(value, np.ndarray) and value.dtype.kind in "OSU"


# -- feature specs -------------------------------------------------------------------------

def _feature_dtype(dtype: Any) -> Any:
    d = as_dtype(dtype)
    if d in (torch.int64, torch.float32) or d == STRING:
        return d
    raise ValueError(
        f"Example features are int64, float32 or string (tf.train.Example has no other "
        f"types), got {dtype!r}"
    )


@dataclasses.dataclass(frozen=True)
class FixedLenFeature:
    """A feature with a fixed number of values, returned as a tensor of ``shape``."""

    shape: Sequence[int]
    dtype: Any
    default_value: Any = None

    def __post_init__(self) -> None:
        shape = (self.shape,) if isinstance(self.shape, int) else tuple(self.shape)
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        object.__setattr__(self, "dtype", _feature_dtype(self.dtype))


@dataclasses.dataclass(frozen=True)
class FixedLenSequenceFeature:
    """Any number of values of ``shape`` each, returned as ``[n, *shape]``."""

    shape: Sequence[int]
    dtype: Any
    allow_missing: bool = False
    default_value: Any = None

    def __post_init__(self) -> None:
        shape = (self.shape,) if isinstance(self.shape, int) else tuple(self.shape)
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        object.__setattr__(self, "dtype", _feature_dtype(self.dtype))


@dataclasses.dataclass(frozen=True)
class VarLenFeature:
    """Any number of values: a 1-D tensor per example, a Ragged per batch."""

    dtype: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _feature_dtype(self.dtype))


_KIND = {torch.int64: "int64", torch.float32: "float", STRING: "bytes"}


def _values(name: str, decoded: dict[str, tuple[str, Any]], feature: Any, index: int
            ) -> Any | None:
    """The feature's values as a flat numpy array, or None when absent."""
    if name not in decoded:
        return None
    kind, values = decoded[name]
    want = _KIND[feature.dtype]
    if kind == "none":
        return None if not isinstance(feature, VarLenFeature) else _empty(feature.dtype)
    if kind != want:
        raise ExampleParseError(
            f"Key: {name}, Index: {index}. Data types don't match. Data type: {kind} but "
            f"expected type: {want}"
        )
    if kind == "bytes":
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
        return arr
    return np.asarray(values, dtype=np.float32 if kind == "float" else np.int64)


def _empty(dtype: Any) -> np.ndarray:
    if dtype == STRING:
        return np.empty(0, dtype=object)
    return np.zeros(0, dtype=np.float32 if dtype == torch.float32 else np.int64)


def _to_output(arr: np.ndarray, dtype: Any) -> Any:
    if dtype == STRING:
        return arr
    return torch.from_numpy(np.array(arr, copy=True, order="C"))


def _default_array(feature: Any, count: int | None) -> np.ndarray:
    dv = feature.default_value
    if feature.dtype == STRING:
        values = [v.encode() if isinstance(v, str) else v for v in np.asarray(
            dv, dtype=object).reshape(-1)]
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
    else:
        arr = np.asarray(dv, dtype=np.float32 if feature.dtype == torch.float32 else np.int64
                         ).reshape(-1)
    if count is not None and arr.size == 1 and count != 1:
        arr = np.repeat(arr, count)
    return arr


def _fixed(name: str, values: np.ndarray | None, feature: FixedLenFeature, index: int
           ) -> np.ndarray:
    count = int(np.prod(feature.shape, dtype=np.int64))
    if values is None:
        if feature.default_value is None:
            raise ExampleParseError(
                f"Feature: {name} (data type: {_KIND[feature.dtype]}) is required but could not "
                f"be found (example {index}); give FixedLenFeature a default_value"
            )
        values = _default_array(feature, count)
    if values.size != count:
        raise ExampleParseError(
            f"Key: {name}, Index: {index}. Number of values != expected. values size: "
            f"{values.size} but output shape: {list(feature.shape)}"
        )
    return values.reshape(feature.shape)


def _sequence(name: str, values: np.ndarray | None, feature: FixedLenSequenceFeature,
              index: int) -> np.ndarray:
    inner = int(np.prod(feature.shape, dtype=np.int64))
    if values is None:
        if not feature.allow_missing:
            raise ExampleParseError(
                f"Feature: {name} is required but could not be found (example {index}); "
                "set allow_missing=True"
            )
        values = _empty(feature.dtype)
    if inner == 0 or values.size % inner:
        raise ExampleParseError(
            f"Key: {name}, Index: {index}. Number of values {values.size} is not a multiple "
            f"of the element shape {list(feature.shape)}"
        )
    return values.reshape(-1, *feature.shape)


def _check_spec(features: Mapping[str, Any]) -> None:
    if not isinstance(features, Mapping) or not features:
        raise TypeError("features must be a non-empty dict of name -> FixedLenFeature / "
                        "FixedLenSequenceFeature / VarLenFeature")
    for name, f in features.items():
        if not isinstance(f, FixedLenFeature | FixedLenSequenceFeature | VarLenFeature):
            raise TypeError(
                f"feature {name!r}: {type(f).__name__} is not supported; use FixedLenFeature, "
                "FixedLenSequenceFeature or VarLenFeature"
            )


def parse_single_example(serialized: bytes, features: Mapping[str, Any]) -> dict[str, Any]:
    """One serialized Example -> {name: tensor} by the feature spec (tf.io.parse_single_example)."""
    _check_spec(features)
    decoded = decode_example(serialized)
    out: dict[str, Any] = {}
    for name, f in features.items():
        values = _values(name, decoded, f, 0)
        if isinstance(f, FixedLenFeature):
            out[name] = _to_output(_fixed(name, values, f, 0), f.dtype)
        elif isinstance(f, FixedLenSequenceFeature):
            out[name] = _to_output(_sequence(name, values, f, 0), f.dtype)
        else:
            out[name] = _to_output(values if values is not None else _empty(f.dtype), f.dtype)
    return out


def _serialized_list(serialized: Any) -> list[bytes]:
    if isinstance(serialized, bytes):
        return [serialized]
    if isinstance(serialized, np.ndarray) and serialized.dtype.kind == "S":
        raise TypeError(
            "parse_example got a fixed-width numpy bytes array ('S' dtype), which drops "
            "trailing zero bytes of serialized records; pass a list or an object array"
        )
    return [bytes(s) for s in (serialized.reshape(-1) if isinstance(serialized, np.ndarray)
                               else serialized)]


def parse_example(serialized: Any, features: Mapping[str, Any]) -> dict[str, Any]:
    """A batch of serialized Examples -> {name: batched value} (tf.io.parse_example):
    ``[B, *shape]`` tensors for FixedLenFeature, ``[B, max_n, *shape]`` padded with the
    default for FixedLenSequenceFeature, a Ragged of B rows for VarLenFeature."""
    _check_spec(features)
    records = _serialized_list(serialized)
    decoded = [decode_example(r) for r in records]
    out: dict[str, Any] = {}
    for name, f in features.items():
        per = [_values(name, d, f, i) for i, d in enumerate(decoded)]
        if isinstance(f, FixedLenFeature):
            arrays = [_fixed(name, v, f, i) for i, v in enumerate(per)]
            stacked = (np.stack(arrays) if arrays else
                       np.zeros((0, *f.shape), dtype=_empty(f.dtype).dtype))
            out[name] = _to_output(stacked, f.dtype)
        elif isinstance(f, FixedLenSequenceFeature):
            arrays = [_sequence(name, v, f, i) for i, v in enumerate(per)]
            longest = max((len(a) for a in arrays), default=0)
            fill = (_default_array(f, None)[0] if f.default_value is not None
                    else (b"" if f.dtype == STRING else 0))
            padded = np.empty((len(arrays), longest, *f.shape), dtype=_empty(f.dtype).dtype)
            padded[...] = fill
            for i, a in enumerate(arrays):
                padded[i, : len(a)] = a
            out[name] = _to_output(padded, f.dtype)
        else:
            rows = [v if v is not None else _empty(f.dtype) for v in per]
            splits = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
            flat = np.concatenate(rows) if rows else _empty(f.dtype)
            if f.dtype == STRING:
                values: Any = np.empty(len(flat), dtype=object)
                values[:] = list(flat)
            else:
                values = torch.from_numpy(np.ascontiguousarray(flat))
            out[name] = Ragged(values, splits)
    return out
