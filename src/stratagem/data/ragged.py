"""Ragged: rows of different lengths as flat values plus row splits (tf.RaggedTensor's layout).

stratagem represents a ragged value (``ragged_batch``, ``VarLenFeature`` in ``parse_example``)
as one :class:`Ragged`: ``values`` holds the rows concatenated along their first dimension
(a tensor, or a numpy object array of ``bytes`` for strings) and ``row_splits`` (int64) says
where each row starts and ends, as in ``tf.RaggedTensor.from_row_splits``. Rows may have any
trailing shape as long as it is the same for all rows (one ragged dimension). It converts to a
padded tensor (``to_tensor``), a list of rows (``rows``/``to_list``), a torch nested tensor
(``to_nested``) or a sparse COO tensor (``to_sparse``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def _is_text_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.dtype.kind in "OSU"


def _as_rows_tensor(row: Any) -> Any:
    if isinstance(row, torch.Tensor):
        return row
    if isinstance(row, np.ndarray):
        if row.dtype.kind in "OSU":
            return row.astype(object)
        return torch.from_numpy(np.ascontiguousarray(row))
    if isinstance(row, list | tuple):
        if row and isinstance(row[0], bytes | str):
            out = np.empty(len(row), dtype=object)
            out[:] = list(row)
            return out
        return torch.as_tensor(row)
    return torch.as_tensor(row)


class Ragged:
    """``nrows`` rows of shapes ``[n_i, *inner]``: ``values`` ``[sum n_i, *inner]`` and
    ``row_splits`` ``[nrows + 1]`` (int64, starting at 0, non-decreasing)."""

    __slots__ = ("values", "row_splits")

    def __init__(self, values: Any, row_splits: Any) -> None:
        splits = torch.as_tensor(row_splits, dtype=torch.int64)
        if splits.ndim != 1 or len(splits) < 1 or int(splits[0]) != 0:
            raise ValueError(f"row_splits must be 1-D and start at 0, got {splits.tolist()}")
        if len(splits) > 1 and bool((splits[1:] < splits[:-1]).any()):
            raise ValueError(f"row_splits must be non-decreasing, got {splits.tolist()}")
        if int(splits[-1]) != len(values):
            raise ValueError(
                f"row_splits end at {int(splits[-1])} but there are {len(values)} values"
            )
        self.values, self.row_splits = values, splits

    @staticmethod
    def from_rows(rows: Sequence[Any]) -> Ragged:
        """A Ragged of ``rows`` (tensors, arrays or lists with a common trailing shape)."""
        converted = [_as_rows_tensor(r) for r in rows]
        lengths = [len(r) if np.ndim(r) else 1 for r in converted]
        splits = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        if not converted:
            return Ragged(torch.zeros(0), splits)
        inner = {tuple(np.shape(r))[1:] for r in converted}
        if len(inner) > 1:
            raise ValueError(
                f"Ragged supports one ragged dimension: rows must agree after their first "
                f"dimension, got trailing shapes {sorted(inner)}"
            )
        if any(_is_text_array(r) for r in converted):
            values: Any = np.empty(int(splits[-1]), dtype=object)
            values[:] = [v for r in converted for v in np.asarray(r, dtype=object).reshape(-1)]
        else:
            # the dtype of the first non-empty row (an empty Python list has no dtype)
            dtype = next((r.dtype for r in converted if r.numel()), converted[0].dtype)
            values = torch.cat([(r.reshape(-1, *r.shape[1:]) if r.ndim else r.reshape(1)).to(dtype)
                                for r in converted])
        return Ragged(values, splits)

    # -- views ---------------------------------------------------------------------
    @property
    def nrows(self) -> int:
        return len(self.row_splits) - 1

    @property
    def shape(self) -> tuple[int | None, ...]:
        """``(nrows, None, *inner)``; the ragged dimension is None."""
        return (self.nrows, None, *tuple(np.shape(self.values))[1:])

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    def row_lengths(self) -> torch.Tensor:
        return self.row_splits[1:] - self.row_splits[:-1]

    def value_rowids(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.nrows), self.row_lengths())

    def __len__(self) -> int:
        return self.nrows

    def __getitem__(self, i: int) -> Any:
        if not isinstance(i, int | np.integer):
            raise TypeError(f"Ragged rows are indexed by int, got {type(i).__name__}")
        n = self.nrows
        if not -n <= i < n:
            raise IndexError(f"row {i} of a Ragged with {n} rows")
        i = int(i) % n
        return self.values[int(self.row_splits[i]):int(self.row_splits[i + 1])]

    def rows(self) -> list[Any]:
        return [self[i] for i in range(self.nrows)]

    def to_list(self) -> list[Any]:
        return [r.tolist() for r in self.rows()]

    def to_tensor(self, default_value: Any = 0) -> torch.Tensor:
        """Rows padded with ``default_value`` to the longest: ``[nrows, max_len, *inner]``."""
        if _is_text_array(self.values):
            raise TypeError("to_tensor() needs numeric values; use rows() for strings")
        width = int(self.row_lengths().max()) if self.nrows else 0
        out = torch.full((self.nrows, width, *self.values.shape[1:]), default_value,
                         dtype=self.values.dtype)
        for i, row in enumerate(self.rows()):
            out[i, : len(row)] = row
        return out

    def to_nested(self) -> torch.Tensor:
        """A torch nested tensor (jagged layout) of the rows (numeric values only)."""
        if _is_text_array(self.values):
            raise TypeError("to_nested() needs numeric values; use rows() for strings")
        return torch.nested.nested_tensor_from_jagged(self.values, offsets=self.row_splits)

    def to_sparse(self) -> torch.Tensor:
        """A sparse COO tensor ``[nrows, max_len, *inner]`` (tf's SparseTensor of a
        VarLenFeature is this with ``values`` as its values, in row order)."""
        if _is_text_array(self.values):
            raise TypeError("to_sparse() needs numeric values")
        if self.values.ndim != 1:
            raise ValueError("to_sparse() supports rows of scalars")
        lengths = self.row_lengths()
        cols = torch.arange(len(self.values)) - torch.repeat_interleave(self.row_splits[:-1], lengths)
        width = int(lengths.max()) if self.nrows else 0
        return torch.sparse_coo_tensor(
            torch.stack([self.value_rowids(), cols]), self.values, (self.nrows, width),
            check_invariants=True,
        )

    # -- comparison, printing, state -------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ragged):
            return NotImplemented
        if not torch.equal(self.row_splits, other.row_splits):
            return False
        if isinstance(self.values, torch.Tensor) and isinstance(other.values, torch.Tensor):
            return self.values.dtype == other.values.dtype and torch.equal(self.values, other.values)
        return bool(np.array_equal(np.asarray(self.values), np.asarray(other.values)))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Ragged({self.to_list()})"

    def to_state(self) -> dict[str, Any]:
        from stratagem.data.structure import to_json

        return {"values": to_json(self.values), "row_splits": self.row_splits.tolist()}

    @staticmethod
    def from_state(state: dict[str, Any]) -> Ragged:
        from stratagem.data.structure import from_json

        return Ragged(from_json(state["values"]), state["row_splits"])
