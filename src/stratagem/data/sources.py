"""Source datasets: range, from_tensor_slices, from_tensors, from_generator, list_files, text lines."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, BinaryIO

import numpy as np
import torch

from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.structure import flatten, pack_as


class RangeDataset(Dataset):
    """``range(stop)`` / ``range(start, stop[, step])`` of Python ints."""

    def __init__(self, *args: int) -> None:
        if not 1 <= len(args) <= 3:
            raise TypeError(f"range expects 1 to 3 integers (like Python's range), got {args}")
        self._range = range(*[int(a) for a in args])

    def _cardinality(self) -> int:
        return len(self._range)

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _RangeIterator(self._range)


class _RangeIterator(StatefulIterator):
    def __init__(self, r: range) -> None:
        self.r, self.i = r, 0

    def __next__(self) -> int:
        if self.i >= len(self.r):
            raise StopIteration
        self.i += 1
        return self.r[self.i - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = int(state["index"])


def _to_storage(leaf: Any) -> tuple[Any, bool]:
    """Convert a leaf to array storage; Python lists become numpy arrays (no Python objects)."""
    if isinstance(leaf, torch.Tensor | np.ndarray):
        return leaf, False
    if isinstance(leaf, list):
        arr = np.asarray(leaf)
        if arr.dtype == object:
            raise TypeError(
                "from_tensor_slices got a list that does not form a regular array "
                f"(first items: {leaf[:3]!r}); use equal-length items or padded_batch later"
            )
        return arr, True
    raise TypeError(
        f"from_tensor_slices expects tensors, numpy arrays or lists as leaves, got "
        f"{type(leaf).__name__}; use from_tensors for a single element"
    )


class TensorSlicesDataset(Dataset):
    """Slices of nested tensors/arrays/lists along their first dimension."""

    def __init__(self, tensors: Any) -> None:
        converted = [_to_storage(leaf) for leaf in flatten(tensors)]
        self._template = tensors
        self._leaves = [c[0] for c in converted]
        self._as_python = [c[1] for c in converted]
        sizes = {len(leaf) if leaf.ndim else -1 for leaf in self._leaves}
        if -1 in sizes:
            raise ValueError("from_tensor_slices cannot slice a 0-d value; use from_tensors")
        if len(sizes) != 1:
            raise ValueError(
                f"from_tensor_slices needs leaves with the same first dimension, got sizes "
                f"{[len(leaf) for leaf in self._leaves]}"
            )
        self._n = sizes.pop()

    def _cardinality(self) -> int:
        return self._n

    def _element(self, i: int) -> Any:
        leaves = []
        for leaf, as_py in zip(self._leaves, self._as_python):
            x = leaf[i]
            if as_py and isinstance(x, np.ndarray | np.generic) and np.ndim(x) == 0:
                x = x.item()
            leaves.append(x)
        return pack_as(self._template, leaves)

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _IndexIterator(self._n, self._element)


class _IndexIterator(StatefulIterator):
    def __init__(self, n: int, get: Callable[[int], Any]) -> None:
        self.n, self.get, self.i = n, get, 0

    def __next__(self) -> Any:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.get(self.i - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = int(state["index"])


class TensorsDataset(Dataset):
    """A single element."""

    def __init__(self, tensors: Any) -> None:
        self._value = tensors

    def _cardinality(self) -> int:
        return 1

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _IndexIterator(1, lambda i: self._value)


class GeneratorDataset(Dataset):
    """Elements of ``generator(*args)``; resuming replays the generator up to the position."""

    def __init__(self, generator: Callable[..., Iterable[Any]], args: tuple = ()) -> None:
        if not callable(generator):
            raise TypeError(
                f"from_generator expects a callable returning an iterable, got {generator!r}"
            )
        self._generator, self._args = generator, tuple(args)

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _GeneratorIterator(lambda: iter(self._generator(*self._args)))


class _GeneratorIterator(StatefulIterator):
    def __init__(self, make: Callable[[], Any]) -> None:
        self.make, self.it, self.count = make, None, 0

    def __next__(self) -> Any:
        if self.it is None:
            self.it = self.make()
        x = next(self.it)  # type: ignore[call-overload]
        self.count += 1
        return x

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.it = self.make()
        for _ in range(int(state["count"])):
            next(self.it)  # type: ignore[call-overload]
        self.count = int(state["count"])


def _as_file_array(files: str | Sequence[str] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray([files] if isinstance(files, str | os.PathLike) else list(files), dtype=str)
    if arr.ndim != 1:
        raise ValueError(f"{what} expects a filename or a list of filenames, got {files!r}")
    return arr


class FileSource(Dataset):
    """Base of datasets that read a list of files (the unit FILE auto-sharding splits)."""

    _files: np.ndarray

    def with_files(self, files: np.ndarray) -> FileSource:
        clone = self._with_inputs(())
        assert isinstance(clone, FileSource)
        clone._files = np.asarray(files, dtype=str)
        return clone

    @property
    def files(self) -> list[str]:
        return [str(f) for f in self._files]


class ListFilesDataset(FileSource):
    """Filenames matching glob pattern(s), sorted, then shuffled per epoch unless shuffle=False."""

    def __init__(
        self, file_pattern: str | Sequence[str], shuffle: bool | None = None, seed: int | None = None
    ) -> None:
        patterns = [file_pattern] if isinstance(file_pattern, str) else list(file_pattern)
        matches = sorted({m for p in patterns for m in glob.glob(str(p))})
        if not matches:
            raise ValueError(f"list_files: no files match {patterns!r}; check the pattern")
        self._files = np.asarray(matches, dtype=str)
        self._shuffle = True if shuffle is None else bool(shuffle)
        self._seed = seed

    def _cardinality(self) -> int:
        return len(self._files)

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        files = self._files
        if self._shuffle:
            rng = np.random.default_rng(ctx.seed_sequence(self._seed))
            files = files[rng.permutation(len(files))]
        return _IndexIterator(len(files), lambda i: str(files[i]))


class TextLineDataset(FileSource):
    """Lines of text files (without the line ending), file after file, as ``str``.

    ``encoding=None`` yields ``bytes`` like tf.data. Resume seeks to the saved byte offset.
    """

    def __init__(
        self,
        filenames: str | Sequence[str],
        compression_type: str | None = None,
        buffer_size: int | None = None,
        num_parallel_reads: int | None = None,
        encoding: str | None = "utf-8",
    ) -> None:
        if compression_type not in (None, ""):
            raise ValueError(
                f"TextLineDataset: compression_type {compression_type!r} is not supported; "
                "decompress the files first"
            )
        del buffer_size, num_parallel_reads
        self._files = _as_file_array(filenames, "TextLineDataset")
        self._encoding = encoding

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _LineIterator(self.files, self._encoding)


class _LineIterator(StatefulIterator):
    def __init__(self, files: list[str], encoding: str | None) -> None:
        self.files, self.encoding = files, encoding
        self.file_index, self.offset = 0, 0
        self.fh: BinaryIO | None = None

    def __next__(self) -> Any:
        while self.file_index < len(self.files):
            if self.fh is None:
                self.fh = open(self.files[self.file_index], "rb")  # noqa: SIM115
                self.fh.seek(self.offset)
            line = self.fh.readline()
            if line:
                self.offset = self.fh.tell()
                line = line.rstrip(b"\n").rstrip(b"\r")
                return line.decode(self.encoding) if self.encoding else line
            self.fh.close()
            self.fh, self.file_index, self.offset = None, self.file_index + 1, 0
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        return {"file": self.file_index, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.file_index, self.offset = int(state["file"]), int(state["offset"])

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None

