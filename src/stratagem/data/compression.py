"""Compressed file streams (tf.data's compression_type "", "GZIP", "ZLIB"), read and written."""

from __future__ import annotations

import gzip
import os
import zlib
from typing import Any, BinaryIO

_CHUNK = 1 << 16


def normalize(compression_type: Any, what: str) -> str:
    """"" / "GZIP" / "ZLIB" from tf.data's spellings (None, a TFRecordOptions-like object)."""
    value = getattr(compression_type, "compression_type", compression_type)
    value = "" if value is None else str(value).upper()
    if value not in ("", "GZIP", "ZLIB"):
        raise ValueError(
            f"{what}: compression_type {compression_type!r} is not one of '', 'GZIP', 'ZLIB'"
        )
    return value


class _ZlibReader:
    """Forward-only reader of a zlib stream (the whole file is one stream, as TF writes it)."""

    def __init__(self, path: str) -> None:
        self._fh: BinaryIO = open(path, "rb")  # noqa: SIM115
        self._z = zlib.decompressobj()
        self._buf = b""
        self._pos = 0  # uncompressed bytes handed out

    def read(self, n: int) -> bytes:
        while len(self._buf) < n:
            raw = self._fh.read(_CHUNK)
            if not raw:
                self._buf += self._z.flush()
                break
            self._buf += self._z.decompress(raw)
        out, self._buf = self._buf[:n], self._buf[n:]
        self._pos += len(out)
        return out

    def seek(self, offset: int) -> None:
        if offset < self._pos:
            raise ValueError("a compressed stream only seeks forward")
        while self._pos < offset:
            if not self.read(min(_CHUNK, offset - self._pos)):
                break

    def tell(self) -> int:
        return self._pos

    def readline(self) -> bytes:
        parts = []
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                parts.append(self.read(i + 1))
                return b"".join(parts)
            raw = self._fh.read(_CHUNK)
            if not raw:
                self._buf += self._z.flush()
                parts.append(self.read(len(self._buf)))
                return b"".join(parts)
            self._buf += self._z.decompress(raw)

    def close(self) -> None:
        self._fh.close()


def open_read(path: str, compression: str) -> Any:
    """A binary reader with ``read``, ``readline``, ``seek`` (forward only when compressed),
    ``tell`` and ``close``; offsets count uncompressed bytes."""
    if compression == "GZIP":
        return gzip.open(path, "rb")
    if compression == "ZLIB":
        return _ZlibReader(path)
    return open(path, "rb")  # noqa: SIM115


class _ZlibWriter:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._fh: BinaryIO = open(path, "wb")  # noqa: SIM115
        self._z = zlib.compressobj()

    def write(self, data: bytes) -> None:
        self._fh.write(self._z.compress(data))

    def flush(self) -> None:
        self._fh.write(self._z.flush(zlib.Z_SYNC_FLUSH))
        self._fh.flush()

    def close(self) -> None:
        self._fh.write(self._z.flush())
        self._fh.close()


def open_write(path: str | os.PathLike[str], compression: str) -> Any:
    """A binary writer (``write``, ``flush``, ``close``) for the compression type."""
    if compression == "GZIP":
        return gzip.open(path, "wb")
    if compression == "ZLIB":
        return _ZlibWriter(path)
    return open(path, "wb")  # noqa: SIM115
