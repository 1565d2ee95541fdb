"""TFRecord files: the length-prefixed, CRC32C-checked record format, read and written."""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any

from stratagem.data import checksum as _crc
from stratagem.data import compression
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.sources import FileSource, _as_file_array


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), native; ``crc32c(b"123456789") == 0xE3069283``."""
    return _crc.crc32c(data)


def masked_crc32c(data: bytes) -> int:
    """The masked CRC stored in TFRecord files."""
    return _crc.masked_crc32c(data)


class CorruptRecordError(ValueError):
    """A TFRecord file is truncated or fails its checksum."""


class TFRecordOptions:
    """Like ``tf.io.TFRecordOptions``: the compression type ("", "GZIP" or "ZLIB")."""

    def __init__(self, compression_type: str | None = None) -> None:
        self.compression_type = compression.normalize(compression_type, "TFRecordOptions")


class TFRecordWriter:
    """Writes records: uint64 length, masked crc32c(length), data, masked crc32c(data).

    ``options`` is "", "GZIP", "ZLIB" or a :class:`TFRecordOptions`; a compressed file is
    one gzip/zlib stream of that layout, as TensorFlow writes it.
    """

    def __init__(self, path: str | os.PathLike[str], options: Any = None) -> None:
        kind = compression.normalize(options, "TFRecordWriter")
        self._fh: Any = compression.open_write(path, kind)

    def write(self, record: bytes) -> None:
        if self._fh is None:
            raise ValueError("TFRecordWriter.write after close()")
        if not isinstance(record, bytes | bytearray | memoryview):
            raise TypeError(f"TFRecordWriter.write expects bytes, got {type(record).__name__}")
        data = bytes(record)
        header = struct.pack("<Q", len(data))
        self._fh.write(header + struct.pack("<I", masked_crc32c(header)))
        self._fh.write(data + struct.pack("<I", masked_crc32c(data)))

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TFRecordDataset(FileSource):
    """Records (``bytes``) of TFRecord files, file after file.

    ``compression_type`` is "", "GZIP" or "ZLIB" (one stream per file, as TensorFlow
    writes it); the resume state is the offset in the uncompressed stream, which a restore
    of a compressed file reaches by decompressing up to it.
    ``verify_checksums=False`` skips the CRC check for speed.
    """

    def __init__(
        self,
        filenames: str | Sequence[str],
        compression_type: str | None = None,
        buffer_size: int | None = None,
        num_parallel_reads: int | None = None,
        verify_checksums: bool = True,
    ) -> None:
        self._compression = compression.normalize(compression_type, "TFRecordDataset")
        del buffer_size, num_parallel_reads
        self._files = _as_file_array(filenames, "TFRecordDataset")
        self._verify = verify_checksums

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _RecordIterator(self.files, self._verify, self._compression)

    def _spec(self) -> Any:
        from stratagem.data.spec import TensorSpec

        return TensorSpec((), "bytes")


class _RecordIterator(StatefulIterator):
    def __init__(self, files: list[str], verify: bool, kind: str = "") -> None:
        self.files, self.verify, self.kind = files, verify, kind
        self.file_index, self.offset = 0, 0
        self.fh: Any = None

    def _read(self, n: int, what: str) -> bytes:
        assert self.fh is not None
        data = self.fh.read(n)
        if len(data) != n:
            raise CorruptRecordError(
                f"truncated TFRecord file {self.files[self.file_index]!r}: record at byte "
                f"offset {self.offset} ends inside its {what}; the file is incomplete"
            )
        return data

    def __next__(self) -> bytes:
        while self.file_index < len(self.files):
            if self.fh is None:
                self.fh = compression.open_read(self.files[self.file_index], self.kind)
                self.fh.seek(self.offset)
            header = self.fh.read(12)
            if not header:
                self.fh.close()
                self.fh, self.file_index, self.offset = None, self.file_index + 1, 0
                continue
            if len(header) != 12:
                try:
                    self._read(12 - len(header), "length header")
                finally:
                    self._skip_file()
            (length,) = struct.unpack("<Q", header[:8])
            (length_crc,) = struct.unpack("<I", header[8:])
            if self.verify and masked_crc32c(header[:8]) != length_crc:
                err = CorruptRecordError(
                    f"corrupt TFRecord file {self.files[self.file_index]!r}: the length of the "
                    f"record at byte offset {self.offset} fails its CRC check"
                )
                self._skip_file()  # without a length the rest of the file cannot be read
                raise err
            try:
                data = self._read(length, "data")
                (data_crc,) = struct.unpack("<I", self._read(4, "data checksum"))
            except CorruptRecordError:
                self._skip_file()
                raise
            if self.verify and masked_crc32c(data) != data_crc:
                err = CorruptRecordError(
                    f"corrupt TFRecord file {self.files[self.file_index]!r}: the record at byte "
                    f"offset {self.offset} fails its CRC check"
                )
                self.offset += 16 + length  # ignore_errors() goes on with the next record
                raise err
            self.offset += 16 + length
            return data
        raise StopIteration

    def _skip_file(self) -> None:
        if self.fh is not None:
            self.fh.close()
        self.fh, self.file_index, self.offset = None, self.file_index + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"file": self.file_index, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.file_index, self.offset = int(state["file"]), int(state["offset"])

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None
