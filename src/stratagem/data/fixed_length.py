"""FixedLengthRecordDataset: files of fixed-size records between a header and a footer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stratagem.data import compression
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.sources import FileSource, _as_file_array


class FixedLengthRecordDataset(FileSource):
    """``tf.data.FixedLengthRecordDataset``: after ``header_bytes``, records of
    ``record_bytes`` each (``bytes``) up to the last ``footer_bytes`` of every file. A body
    that is not a whole number of records raises, as tf.data does. Resume seeks to the saved
    (uncompressed) offset."""

    def __init__(
        self,
        filenames: str | Sequence[str],
        record_bytes: int,
        header_bytes: int | None = None,
        footer_bytes: int | None = None,
        buffer_size: int | None = None,
        compression_type: str | None = None,
        num_parallel_reads: int | None = None,
    ) -> None:
        del buffer_size, num_parallel_reads
        self._files = _as_file_array(filenames, "FixedLengthRecordDataset")
        self._record, self._header = int(record_bytes), int(header_bytes or 0)
        self._footer = int(footer_bytes or 0)
        if self._record < 1 or self._header < 0 or self._footer < 0:
            raise ValueError(
                f"FixedLengthRecordDataset: record_bytes must be >= 1 and header/footer >= 0, "
                f"got {record_bytes}, {header_bytes}, {footer_bytes}"
            )
        self._compression = compression.normalize(compression_type, "FixedLengthRecordDataset")

    def _spec(self) -> Any:
        from stratagem.data.spec import TensorSpec

        return TensorSpec((), "string")

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _FixedIterator(self)


class _FixedIterator(StatefulIterator):
    """Keeps ``footer_bytes`` read ahead, so the footer is never returned as a record."""

    def __init__(self, ds: FixedLengthRecordDataset) -> None:
        self.ds, self.files = ds, ds.files
        self.file_index, self.offset = 0, 0
        self.fh: Any = None
        self.ahead = b""

    def __next__(self) -> bytes:
        ds = self.ds
        while self.file_index < len(self.files):
            if self.fh is None:
                self.fh = compression.open_read(self.files[self.file_index], ds._compression)
                start = max(self.offset, ds._header)
                self.fh.seek(start)
                self.offset = start
                self.ahead = self.fh.read(ds._footer) if ds._footer else b""
            data = self.ahead + self.fh.read(ds._record)
            if len(data) >= ds._record + ds._footer:
                self.ahead = data[ds._record:]
                self.offset += ds._record
                return data[: ds._record]
            if len(data) != ds._footer:
                raise ValueError(
                    f"FixedLengthRecordDataset: {self.files[self.file_index]!r} has "
                    f"{len(data) - ds._footer} bytes after its last whole record (at offset "
                    f"{self.offset}); the body must be a multiple of record_bytes={ds._record}"
                )
            self.fh.close()
            self.fh, self.file_index, self.offset, self.ahead = None, self.file_index + 1, 0, b""
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        return {"file": self.file_index, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.file_index, self.offset = int(state["file"]), int(state["offset"])

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None
