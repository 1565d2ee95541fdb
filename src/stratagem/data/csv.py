"""CSV: CsvDataset (typed columns, defaults, selected columns) and make_csv_dataset (header,
type inference, batches of feature dicts), with tf.data's parsing rules.

Elements are tuples of 0-d tensors (int32/int64/float32/float64) and ``str`` for string
columns (tf.data gives ``bytes``). Records are lines; a quoted field may contain the
delimiter, doubled quotes (``""``) and newlines. The resume state is the file and the byte
offset of the next record.
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stratagem.data import compression
from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.sources import FileSource, _as_file_array
from stratagem.data.spec import STRING, as_dtype

_NUMERIC = (torch.int32, torch.int64, torch.float32, torch.float64)


class CsvParseError(ValueError):
    """A CSV record does not fit the column types or defaults."""


def _column(default: Any, index: int) -> tuple[Any, Any]:
    """(dtype, default value or None if the column is required) of a record_defaults entry."""
    if isinstance(default, list | tuple):
        if len(default) > 1:
            raise ValueError(
                f"CsvDataset: record_defaults[{index}] has {len(default)} values; give one "
                "default value, or a dtype for a required column"
            )
        if not default:
            raise ValueError(f"CsvDataset: record_defaults[{index}] is empty; give a dtype")
        default = default[0]
    if isinstance(default, torch.Tensor | np.ndarray):
        arr = default.reshape(-1)
        if len(arr) != 1:
            raise ValueError(f"CsvDataset: record_defaults[{index}] must hold one value")
        dtype = as_dtype(arr.dtype)
        value = arr[0].item()
        return dtype, (value.decode() if isinstance(value, bytes) else value)
    if isinstance(default, str | bytes):
        return STRING, default.decode() if isinstance(default, bytes) else default
    if isinstance(default, bool):
        raise ValueError(f"CsvDataset: record_defaults[{index}]: bool columns are not supported")
    if isinstance(default, int):
        return torch.int32, default
    if isinstance(default, float):
        return torch.float32, default
    dtype = as_dtype(default)
    if dtype not in _NUMERIC and dtype != STRING:
        raise ValueError(
            f"CsvDataset: record_defaults[{index}] has dtype {dtype}; CSV columns are int32, "
            "int64, float32, float64 or string"
        )
    return dtype, None


def split_record(line: str, delim: str, use_quote: bool) -> tuple[list[str], bool]:
    """The fields of a record and whether a quoted field is still open at the end of it."""
    fields: list[str] = []
    field: list[str] = []
    i, n = 0, len(line)
    quoted = False
    at_start = True
    while i < n:
        c = line[i]
        if quoted:
            if c == '"':
                if i + 1 < n and line[i + 1] == '"':
                    field.append('"')
                    i += 2
                    continue
                quoted = False
            else:
                field.append(c)
        elif use_quote and c == '"' and at_start:
            quoted = True
        elif c == delim:
            fields.append("".join(field))
            field, at_start = [], True
            i += 1
            continue
        else:
            field.append(c)
        at_start = False
        i += 1
    fields.append("".join(field))
    return fields, quoted


def _convert(text: str, dtype: Any, default: Any, na_value: str, where: str) -> Any:
    if text == "" or text == na_value:
        if default is None:
            raise CsvParseError(f"{where} is required but missing (no default value)")
        text_or_value = default
        if dtype == STRING:
            return str(text_or_value)
        return torch.tensor(text_or_value, dtype=dtype)
    if dtype == STRING:
        return text
    try:
        value: Any = int(text) if dtype in (torch.int32, torch.int64) else float(text)
    except ValueError:
        raise CsvParseError(
            f"{where}: {text!r} is not a valid {str(dtype).replace('torch.', '')}"
        ) from None
    if dtype == torch.int32 and not -(2**31) <= value < 2**31:
        raise CsvParseError(f"{where}: {text!r} does not fit int32")
    return torch.tensor(value, dtype=dtype)


class CsvDataset(FileSource):
    """``tf.data.experimental.CsvDataset``: one tuple per record of the selected columns,
    typed by ``record_defaults`` (a dtype = required column, a value = its default)."""

    def __init__(
        self,
        filenames: str | Sequence[str],
        record_defaults: Sequence[Any],
        compression_type: str | None = None,
        buffer_size: int | None = None,
        header: bool = False,
        field_delim: str = ",",
        use_quote_delim: bool = True,
        na_value: str = "",
        select_cols: Sequence[int] | None = None,
        exclude_cols: Sequence[int] | None = None,
    ) -> None:
        del buffer_size
        self._files = (_as_file_array(filenames, "CsvDataset") if len(filenames) else
                       np.zeros(0, dtype=str))
        self._columns = [_column(d, i) for i, d in enumerate(record_defaults)]
        if not self._columns:
            raise ValueError("CsvDataset: record_defaults must name at least one column")
        if len(field_delim) != 1:
            raise ValueError(f"CsvDataset: field_delim must be one character, got {field_delim!r}")
        if select_cols is not None and exclude_cols is not None:
            raise ValueError("CsvDataset: give select_cols or exclude_cols, not both")
        for name, cols in (("select_cols", select_cols), ("exclude_cols", exclude_cols)):
            if cols is not None and (list(cols) != sorted(set(cols)) or min(cols, default=0) < 0):
                raise ValueError(f"CsvDataset: {name} must be increasing and >= 0, got {cols}")
        if select_cols is not None and len(select_cols) != len(self._columns):
            raise ValueError(
                f"CsvDataset: {len(select_cols)} select_cols but {len(self._columns)} "
                "record_defaults; give one default per selected column"
            )
        self._select = None if select_cols is None else [int(c) for c in select_cols]
        self._exclude = None if exclude_cols is None else {int(c) for c in exclude_cols}
        self._header, self._delim = bool(header), field_delim
        self._quote, self._na = bool(use_quote_delim), na_value
        self._compression = compression.normalize(compression_type, "CsvDataset")

    def _spec(self) -> Any:
        from stratagem.data.spec import TensorSpec

        return tuple(TensorSpec((), d) for d, _ in self._columns)

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _CsvIterator(self)

    def parse(self, fields: list[str], where: str) -> tuple[Any, ...]:
        if self._select is not None:
            if self._select[-1] >= len(fields):
                raise CsvParseError(
                    f"{where}: has {len(fields)} fields, but select_cols names column "
                    f"{self._select[-1]}"
                )
            chosen = [fields[c] for c in self._select]
        elif self._exclude is not None:
            chosen = [f for c, f in enumerate(fields) if c not in self._exclude]
        else:
            chosen = fields
        if len(chosen) != len(self._columns):
            raise CsvParseError(
                f"{where}: expected {len(self._columns)} fields but got {len(chosen)}"
            )
        return tuple(
            _convert(text, dtype, default, self._na, f"{where}, field {j}")
            for j, (text, (dtype, default)) in enumerate(zip(chosen, self._columns))
        )


class _CsvIterator(StatefulIterator):
    def __init__(self, ds: CsvDataset, raw: bool = False) -> None:
        self.ds, self.raw = ds, raw
        self.files = ds.files
        self.file_index, self.offset, self.record = 0, 0, 0
        self.fh: Any = None

    def _readline(self) -> bytes:
        assert self.fh is not None
        return self.fh.readline()  # type: ignore[no-any-return]

    def __next__(self) -> tuple[Any, ...]:
        ds = self.ds
        while self.file_index < len(self.files):
            if self.fh is None:
                self.fh = compression.open_read(self.files[self.file_index], ds._compression)
                self.fh.seek(self.offset)
                if self.offset == 0 and ds._header:
                    self._readline()
                    self.record = 1
            raw = self._readline()
            if not raw:
                self.fh.close()
                self.fh, self.file_index, self.offset, self.record = (
                    None, self.file_index + 1, 0, 0)
                continue
            text = raw.decode("utf-8")
            fields, open_quote = split_record(text.rstrip("\r\n"), ds._delim, ds._quote)
            while open_quote:  # a quoted field continues on the next line
                more = self._readline()
                if not more:
                    raise CsvParseError(
                        f"{self.files[self.file_index]}: record {self.record} ends inside a "
                        "quoted field"
                    )
                text += more.decode("utf-8")
                fields, open_quote = split_record(text.rstrip("\r\n"), ds._delim, ds._quote)
            self.offset = self.fh.tell()
            where = f"{self.files[self.file_index]}: record {self.record}"
            self.record += 1
            return tuple(fields) if self.raw else ds.parse(fields, where)
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        return {"file": self.file_index, "offset": self.offset, "record": self.record}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.file_index, self.offset = int(state["file"]), int(state["offset"])
        self.record = int(state["record"])

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


# -- make_csv_dataset ----------------------------------------------------------------------

_INT32 = (-(2**31), 2**31 - 1)


def infer_type(text: str, na_value: str, previous: Any) -> Any:
    """tf.data's inference step: the least permissive of int32, int64, float32, float64,
    string that holds this value and every earlier one."""
    if text in ("", na_value):
        return previous
    order = [torch.int32, torch.int64, torch.float32, torch.float64, STRING]

    def fits(dtype: Any) -> bool:
        if dtype in (torch.int32, torch.int64):
            try:
                v = int(text)
            except ValueError:
                return False
            return _INT32[0] <= v <= _INT32[1] if dtype == torch.int32 else -(2**63) <= v < 2**63
        if dtype in (torch.float32, torch.float64):
            try:
                return bool(abs(float(np.dtype(
                    "float32" if dtype == torch.float32 else "float64").type(text))) < np.finfo(
                    "float32" if dtype == torch.float32 else "float64").max)
            except (ValueError, OverflowError):
                return False
        return True

    for i, dtype in enumerate(order):
        if fits(dtype) and (previous is None or previous in order[: i + 1]):
            return dtype
    return STRING


def _files_of(file_pattern: str | Sequence[str]) -> list[str]:
    patterns = [file_pattern] if isinstance(file_pattern, str) else list(file_pattern)
    files = sorted({m for p in patterns for m in glob.glob(str(p))})
    if not files:
        raise ValueError(f"make_csv_dataset: no files match {patterns!r}")
    return files


def _read_rows(files: list[str], delim: str, quote: bool, header: bool, kind: str,
               limit: int | None) -> list[list[str]]:
    """The raw fields of the first ``limit`` records (for the header and type inference)."""
    ds = CsvDataset(files, [STRING], compression_type=kind, header=header, field_delim=delim,
                    use_quote_delim=quote)
    it = _CsvIterator(ds, raw=True)
    rows: list[list[str]] = []
    try:
        while limit is None or len(rows) < limit:
            try:
                rows.append(list(next(it)))
            except StopIteration:
                break
    finally:
        it.close()
    return rows


def make_csv_dataset(
    file_pattern: str | Sequence[str],
    batch_size: int,
    column_names: Sequence[str] | None = None,
    column_defaults: Sequence[Any] | None = None,
    label_name: str | None = None,
    select_columns: Sequence[Any] | None = None,
    field_delim: str = ",",
    use_quote_delim: bool = True,
    na_value: str = "",
    header: bool = True,
    num_epochs: int | None = None,
    shuffle: bool = True,
    shuffle_buffer_size: int = 10000,
    shuffle_seed: int | None = None,
    prefetch_buffer_size: int | None = None,
    num_parallel_reads: int | None = None,
    sloppy: bool = False,
    num_rows_for_inference: int | None = 100,
    compression_type: str | None = None,
    ignore_errors: bool = False,
    encoding: str = "utf-8",
) -> Dataset:
    """tf.data.experimental.make_csv_dataset: batches of {column: tensor} (and the label
    column apart when ``label_name`` is given), built as tf.data builds it: files (shuffled
    when ``shuffle``) interleaved, shuffled, repeated ``num_epochs`` (None: forever, then every
    batch is full), batched."""
    if encoding.lower().replace("-", "") != "utf8":
        raise ValueError(f"make_csv_dataset: only utf-8 files are read, got {encoding!r}")
    kind = compression.normalize(compression_type, "make_csv_dataset")
    files = _files_of(file_pattern)
    if column_names is None:
        if not header:
            raise ValueError("make_csv_dataset: without a header, give column_names")
        first = _read_rows(files[:1], field_delim, use_quote_delim, False, kind, 1)
        if not first:
            raise ValueError(f"make_csv_dataset: {files[0]} is empty; it has no header")
        column_names = first[0]
    column_names = list(column_names)
    if len(set(column_names)) != len(column_names):
        raise ValueError(f"make_csv_dataset: column names are not unique: {column_names}")
    select: list[int] | None = None
    if select_columns is not None:
        idx = []
        for c in select_columns:
            if isinstance(c, str):
                if c not in column_names:
                    raise ValueError(
                        f"make_csv_dataset: select_columns names {c!r}, not among the columns "
                        f"{column_names}"
                    )
                idx.append(column_names.index(c))
            else:
                idx.append(int(c))
        select = sorted(idx)
        column_names = [column_names[i] for i in select]
    if label_name is not None and label_name not in column_names:
        raise ValueError(
            f"make_csv_dataset: label_name {label_name!r} is not among the columns {column_names}"
        )
    if column_defaults is None:
        rows = _read_rows(files, field_delim, use_quote_delim, header, kind,
                          num_rows_for_inference)
        cols = select if select is not None else list(range(len(column_names)))
        types: list[Any] = [None] * len(cols)
        for row in rows:
            for j, c in enumerate(cols):
                if c < len(row):
                    types[j] = infer_type(row[c], na_value, types[j])
        column_defaults = [("" if t in (None, STRING) else torch.tensor([0], dtype=t))
                           for t in types]
    column_defaults = list(column_defaults)
    if len(column_defaults) != len(column_names):
        raise ValueError(
            f"make_csv_dataset: {len(column_defaults)} column_defaults for "
            f"{len(column_names)} columns"
        )

    names = tuple(column_names)

    def read(filename: str) -> Dataset:
        ds = CsvDataset(filename, column_defaults, compression_type=kind, header=header,
                        field_delim=field_delim, use_quote_delim=use_quote_delim,
                        na_value=na_value, select_cols=select)
        return ds.ignore_errors() if ignore_errors else ds

    def to_features(*columns: Any) -> Any:
        features = dict(zip(names, columns))
        if label_name is not None:
            label = features.pop(label_name)
            return features, label
        return features

    ds = Dataset.from_tensor_slices(np.asarray(files))
    if shuffle:
        ds = ds.shuffle(len(files), seed=shuffle_seed)
    ds = ds.interleave(read, cycle_length=num_parallel_reads or 1, block_length=1,
                       num_parallel_calls=num_parallel_reads,
                       deterministic=not sloppy if sloppy else None)
    if shuffle:
        ds = ds.shuffle(shuffle_buffer_size, seed=shuffle_seed)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    ds = ds.batch(batch_size, drop_remainder=num_epochs is None)
    ds = ds.map(to_features)
    if prefetch_buffer_size is not None and prefetch_buffer_size != 0:
        ds = ds.prefetch(prefetch_buffer_size)
    return ds


def decode_csv(
    records: Any,
    record_defaults: Sequence[Any],
    field_delim: str = ",",
    use_quote_delim: bool = True,
    na_value: str = "",
    select_cols: Sequence[int] | None = None,
) -> list[Any]:
    """``tf.io.decode_csv``: CSV lines -> one value per column. A single line gives 0-d
    tensors (``str`` for strings); a list/array of lines gives a tensor (a numpy string
    array) per column, in the lines' shape."""
    ds = CsvDataset([], record_defaults, field_delim=field_delim,
                    use_quote_delim=use_quote_delim, na_value=na_value, select_cols=select_cols)
    single = isinstance(records, str | bytes)
    arr = np.asarray([records] if single else records, dtype=object)
    rows = []
    for i, line in enumerate(arr.reshape(-1)):
        text = line.decode("utf-8") if isinstance(line, bytes) else str(line)
        fields, open_quote = split_record(text, field_delim, use_quote_delim)
        if open_quote:
            raise CsvParseError(f"decode_csv: record {i} ends inside a quoted field")
        rows.append(ds.parse(fields, f"decode_csv: record {i}"))
    if single:
        return list(rows[0])
    out: list[Any] = []
    for j, (dtype, _) in enumerate(ds._columns):
        column = [r[j] for r in rows]
        if dtype == STRING:
            out.append(np.asarray(column, dtype=object).reshape(arr.shape))
        else:
            out.append(torch.stack(column).reshape(arr.shape) if column
                       else torch.zeros(arr.shape, dtype=dtype))
    return out
