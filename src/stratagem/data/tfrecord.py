"""TFRecord files: the length-prefixed, CRC32C-checked record format, read and written."""

from __future__ import annotations

import os
import struct
import zlib
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


_CHUNK = 1 << 24  # records longer than this are read in pieces, so a garbage length is
# found to run past the end of the file before it is allocated


class _RecordIterator(StatefulIterator):
    def __init__(self, files: list[str], verify: bool, kind: str = "") -> None:
        self.files, self.verify, self.kind = files, verify, kind
        self.file_index, self.offset = 0, 0
        self.record: int | None = 0  # index of the next record in its file (None: unknown)
        self.fh: Any = None
        self.size: int | None = None  # size of an uncompressed file

    def _where(self) -> str:
        rec = f"record {self.record}" if self.record is not None else "the record"
        return (
            f"TFRecord file {self.files[self.file_index]!r}: {rec} at byte offset {self.offset}"
        )

    def _hint(self) -> str:
        if self.kind:
            return (
                f"the file is corrupt or not a {self.kind}-compressed TFRecord file; "
                "re-create it, or skip bad records with ignore_errors()"
            )
        return (
            "the file is corrupt or not a TFRecord file; re-create it, pass "
            'compression_type="GZIP"/"ZLIB" if it is compressed, or skip bad records '
            "with ignore_errors()"
        )

    def _raw(self, n: int) -> bytes:
        """Up to ``n`` bytes of the (uncompressed) stream; a compressed stream that cannot be
        decompressed (cut short, not of its kind) is a corrupt record naming the file."""
        assert self.fh is not None
        try:
            return self.fh.read(n)  # type: ignore[no-any-return]
        except (OSError, EOFError, zlib.error) as e:
            if not self.kind:
                raise
            err = CorruptRecordError(
                f"corrupt {self._where()}: the {self.kind} stream cannot be decompressed "
                f"({type(e).__name__}: {e}); {self._hint()}"
            )
            raise err from e

    def _read(self, n: int, what: str) -> bytes:
        assert self.fh is not None
        if n <= _CHUNK:
            data = self._raw(n)
        else:
            parts, got = [], 0
            while got < n:
                part = self._raw(min(_CHUNK, n - got))
                if not part:
                    break
                parts.append(part)
                got += len(part)
            data = b"".join(parts)
        if len(data) != n:
            raise CorruptRecordError(
                f"truncated {self._where()} ends inside its {what} ({what} needs {n} bytes, "
                f"{len(data)} remain); {self._hint()}"
            )
        return data

    def __next__(self) -> bytes:
        while self.file_index < len(self.files):
            if self.fh is None:
                path = self.files[self.file_index]
                self.fh = compression.open_read(path, self.kind)
                self.fh.seek(self.offset)
                self.size = None if self.kind else os.fstat(self.fh.fileno()).st_size
            try:
                header = self._raw(12)
            except CorruptRecordError:
                self._skip_file()
                raise
            if not header:
                self.fh.close()
                self.fh, self.file_index, self.offset = None, self.file_index + 1, 0
                self.record = 0
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
                    f"corrupt {self._where()}: its length field fails its CRC check; "
                    f"{self._hint()}"
                )
                self._skip_file()  # without a length the rest of the file cannot be read
                raise err
            if self.size is not None and length + 4 > self.size - self.offset - 12:
                err = CorruptRecordError(
                    f"corrupt {self._where()}: its length field says {length} bytes but only "
                    f"{max(self.size - self.offset - 12, 0)} bytes remain in the file "
                    f"({self.size} bytes); {self._hint()}"
                )
                self._skip_file()
                raise err
            try:
                data = self._read(length, "data")
                (data_crc,) = struct.unpack("<I", self._read(4, "data checksum"))
            except CorruptRecordError:
                self._skip_file()
                raise
            if self.verify and masked_crc32c(data) != data_crc:
                err = CorruptRecordError(
                    f"corrupt {self._where()}: its data fails its CRC check; {self._hint()}"
                )
                self._advance(length)  # ignore_errors() goes on with the next record
                raise err
            self._advance(length)
            return data
        raise StopIteration

    def _advance(self, length: int) -> None:
        self.offset += 16 + length
        if self.record is not None:
            self.record += 1

    def _skip_file(self) -> None:
        if self.fh is not None:
            self.fh.close()
        self.fh, self.file_index, self.offset = None, self.file_index + 1, 0
        self.record = 0

    def state_dict(self) -> dict[str, Any]:
        return {"file": self.file_index, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.file_index, self.offset = int(state["file"]), int(state["offset"])
        self.record = 0 if self.offset == 0 else None

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None
