"""Source datasets: range, from_tensor_slices, from_tensors, from_generator, list_files, text lines."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.structure import flatten, normalize, pack_as, to_tensor


def _int64(value: int) -> torch.Tensor:
    """A scalar as tf.data's range/counter/random/enumerate yield it: an int64 tensor."""
    return torch.tensor(value, dtype=torch.int64)


class RangeDataset(Dataset):
    """``range(stop)`` / ``range(start, stop[, step])`` as int64 scalar tensors (tf.data's)."""

    def __init__(self, *args: int) -> None:
        if not 1 <= len(args) <= 3:
            raise TypeError(f"range expects 1 to 3 integers (like Python's range), got {args}")
        self._range = range(*[int(a) for a in args])

    def _cardinality(self) -> int:
        return len(self._range)

    def _spec(self) -> Any:
        from stratagem.data.spec import TensorSpec

        return TensorSpec((), "int64")

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _RangeIterator(self._range)


class _RangeIterator(StatefulIterator):
    def __init__(self, r: range) -> None:
        self.r, self.i = r, 0

    def __next__(self) -> torch.Tensor:
        if self.i >= len(self.r):
            raise StopIteration
        self.i += 1
        return _int64(self.r[self.i - 1])

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = int(state["index"])


def _to_storage(leaf: Any) -> Any:
    """A leaf as tf.data holds it (see :func:`~stratagem.data.structure.to_tensor`): numbers
    as torch tensors (Python lists with tf's dtypes: float32, int32), text as numpy arrays."""
    if isinstance(leaf, list | np.ndarray | torch.Tensor):
        return to_tensor(leaf)
    raise TypeError(
        f"from_tensor_slices expects tensors, numpy arrays or lists as leaves, got "
        f"{type(leaf).__name__}; use from_tensors for a single element"
    )


class TensorSlicesDataset(Dataset):
    """Slices of nested tensors/arrays/lists along their first dimension."""

    def __init__(self, tensors: Any) -> None:
        self._template = tensors
        self._leaves = [_to_storage(leaf) for leaf in flatten(tensors)]
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

    def _spec(self) -> Any:
        from stratagem.data.spec import STRING, TensorSpec, as_dtype

        specs = [
            TensorSpec(tuple(leaf.shape[1:]), STRING if isinstance(leaf, np.ndarray)
                       else as_dtype(leaf.dtype))
            for leaf in self._leaves
        ]
        return pack_as(self._template, specs)

    def _element(self, i: int) -> Any:
        leaves = []
        for leaf in self._leaves:
            x = leaf[i]
            if isinstance(x, np.generic):  # one text item: str or bytes
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
    """A single element (leaves converted as tf converts them: lists and Python numbers
    become tensors, tuples and dicts stay structure)."""

    def __init__(self, tensors: Any) -> None:
        self._value = normalize(tensors)

    def _cardinality(self) -> int:
        return 1

    def _spec(self) -> Any:
        from stratagem.data.spec import spec_of

        return spec_of(self._value)

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _IndexIterator(1, lambda i: self._value)


class GeneratorDataset(Dataset):
    """Elements of ``generator(*args)``; resuming replays the generator up to the position.

    With ``output_signature`` (a structure of TensorSpec/RaggedSpec) every element is
    converted to its dtypes and checked against its shapes (a ValueError names the element),
    and ``element_spec`` is the signature. The older ``output_types``/``output_shapes`` build
    the same signature.
    """

    def __init__(
        self,
        generator: Callable[..., Iterable[Any]],
        args: tuple = (),
        output_signature: Any = None,
    ) -> None:
        if not callable(generator):
            raise TypeError(
                f"from_generator expects a callable returning an iterable, got {generator!r}"
            )
        self._generator, self._args = generator, tuple(args)
        self._signature = output_signature

    def _spec(self) -> Any:
        return self._signature

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        make = lambda: iter(self._generator(*self._args))  # noqa: E731
        if self._signature is None:
            return _GeneratorIterator(lambda: (normalize(x) for x in make()))
        from stratagem.data.spec import convert

        signature = self._signature

        def checked() -> Any:
            for i, x in enumerate(make()):
                yield convert(x, signature, "from_generator", i)

        return _GeneratorIterator(checked)


def signature_from(output_types: Any, output_shapes: Any) -> Any:
    """tf's older from_generator(output_types, output_shapes) as an output_signature."""
    from stratagem.data.spec import TensorSpec

    def build(t: Any, s: Any) -> Any:
        if isinstance(t, tuple):
            parts = s if s is not None else [None] * len(t)
            return tuple(build(ti, si) for ti, si in zip(t, parts))
        if isinstance(t, dict):
            return {k: build(t[k], None if s is None else s[k]) for k in t}
        return TensorSpec(None if s is None else tuple(s), t)

    return build(output_types, output_shapes)


class CounterDataset(Dataset):
    """``counter(start, step)``: start, start + step, ... forever (tf.data.Dataset.counter)."""

    def __init__(self, start: int = 0, step: int = 1) -> None:
        self._start, self._step = int(start), int(step)

    def _cardinality(self) -> int:
        return -1

    def _spec(self) -> Any:
        from stratagem.data.spec import TensorSpec

        return TensorSpec((), "int64")

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _CounterIterator(self._start, self._step)


class _CounterIterator(StatefulIterator):
    def __init__(self, start: int, step: int) -> None:
        self.start, self.step, self.i = start, step, 0

    def __next__(self) -> Any:
        self.i += 1
        return _int64(self.start + (self.i - 1) * self.step)

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = int(state["index"])


class RandomDataset(Dataset):
    """``Dataset.random(seed)``: random int64 values forever, seeded from (seed, epoch, index)
    (a different stream from TensorFlow's)."""

    def __init__(self, seed: int | None = None, rerandomize_each_iteration: bool | None = None
                 ) -> None:
        self._seed, self._rerandomize = seed, rerandomize_each_iteration

    def _cardinality(self) -> int:
        return -1

    def _spec(self) -> Any:
        from stratagem.data.spec import TensorSpec

        return TensorSpec((), "int64")

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        import dataclasses

        if self._seed is not None and not self._rerandomize:
            ctx = dataclasses.replace(ctx, epoch=())
        return _RandomIterator(ctx, self._seed)


class _RandomIterator(_CounterIterator):
    def __init__(self, ctx: Context, seed: int | None) -> None:
        super().__init__(0, 1)
        self.ctx, self.seed = ctx, seed

    def __next__(self) -> Any:
        i = int(super().__next__())
        state = self.ctx.seed_sequence(self.seed, i).generate_state(2, np.uint32)
        return _int64(int(np.int64((int(state[0]) << 32 | int(state[1])) - (1 << 63))))


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

    def _spec(self) -> Any:
        from stratagem.data.spec import TensorSpec

        return TensorSpec((), "string")

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        files = self._files
        if self._shuffle:
            rng = np.random.default_rng(ctx.seed_sequence(self._seed))
            files = files[rng.permutation(len(files))]
        return _IndexIterator(len(files), lambda i: str(files[i]))


class TextLineDataset(FileSource):
    """Lines of text files (without the line ending), file after file, as ``str``.

    ``encoding=None`` yields ``bytes`` like tf.data. ``compression_type`` "GZIP"/"ZLIB"
    reads compressed files. Resume seeks to the saved (uncompressed) byte offset.
    """

    def __init__(
        self,
        filenames: str | Sequence[str],
        compression_type: str | None = None,
        buffer_size: int | None = None,
        num_parallel_reads: int | None = None,
        encoding: str | None = "utf-8",
    ) -> None:
        from stratagem.data import compression

        self._compression = compression.normalize(compression_type, "TextLineDataset")
        del buffer_size, num_parallel_reads
        self._files = _as_file_array(filenames, "TextLineDataset")
        self._encoding = encoding

    def _spec(self) -> Any:
        from stratagem.data.spec import TensorSpec

        return TensorSpec((), "string")

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _LineIterator(self.files, self._encoding, self._compression)


class _LineIterator(StatefulIterator):
    def __init__(self, files: list[str], encoding: str | None, kind: str = "") -> None:
        self.files, self.encoding, self.kind = files, encoding, kind
        self.file_index, self.offset = 0, 0
        self.fh: Any = None

    def __next__(self) -> Any:
        while self.file_index < len(self.files):
            if self.fh is None:
                from stratagem.data import compression

                self.fh = compression.open_read(self.files[self.file_index], self.kind)
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

