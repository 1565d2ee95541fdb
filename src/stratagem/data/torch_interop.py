"""PyTorch interop: wrap torch datasets, and a DataLoader-shaped view of a stratagem Dataset."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from stratagem.data.batching import BatchDataset
from stratagem.data.dataset import Dataset
from stratagem.data.structure import map_structure


def _tuplify(x: Any) -> Any:
    """A torch dataset's sample with torch's ``default_collate`` conventions: lists are
    structure (tuples), Python ``int`` -> int64, ``float`` -> float64, ``bool`` -> bool tensors
    (what a torch loss expects of labels; tf's own int32/float32 apply to tf-style sources)."""
    if isinstance(x, list):
        return tuple(_tuplify(v) for v in x)
    if isinstance(x, tuple):
        items = [_tuplify(v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, dict):
        return {k: _tuplify(v) for k, v in x.items()}
    if isinstance(x, bool):
        return torch.tensor(x)
    if isinstance(x, int):
        return torch.tensor(x, dtype=torch.int64)
    if isinstance(x, float):
        return torch.tensor(x, dtype=torch.float64)
    return x


class _GetItem:
    """Picklable ``index -> torch_dataset[index]`` (lists become tuples, for batching)."""

    def __init__(self, torch_dataset: Any) -> None:
        self.torch_dataset = torch_dataset

    def __call__(self, index: int) -> Any:
        return _tuplify(self.torch_dataset[int(index)])


class _IterOf:
    def __init__(self, torch_dataset: Any) -> None:
        self.torch_dataset = torch_dataset

    def __call__(self) -> Iterator[Any]:
        return (_tuplify(x) for x in self.torch_dataset)


def from_torch(torch_dataset: Any, num_parallel_calls: int | None = None) -> Dataset:
    """Wrap a torch map-style Dataset (indices 0..len-1, fetched with ``map``, optionally in
    parallel) or an IterableDataset (resume replays it up to the saved position)."""
    if isinstance(torch_dataset, tud.IterableDataset):
        return Dataset.from_generator(_IterOf(torch_dataset))
    if hasattr(torch_dataset, "__getitem__") and hasattr(torch_dataset, "__len__"):
        return Dataset.range(len(torch_dataset)).map(
            _GetItem(torch_dataset), num_parallel_calls=num_parallel_calls
        )
    raise TypeError(
        f"from_torch expects a torch map-style Dataset (__getitem__ and __len__) or an "
        f"IterableDataset, got {type(torch_dataset).__name__}"
    )


def _last_batch(ds: Dataset) -> BatchDataset | None:
    node: Dataset | None = ds
    while node is not None:
        if isinstance(node, BatchDataset):
            return node
        node = node._inputs[0] if len(node._inputs) == 1 else None
    return None


class DataLoaderView:
    """What code written for a DataLoader reads: iteration, ``len``, ``batch_size``,
    ``drop_last``, ``dataset``, ``num_workers``, ``sampler``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        batch = _last_batch(dataset)
        self.batch_size = batch.batch_size if batch is not None else None
        self.drop_last = batch.drop_remainder if batch is not None else False
        self.num_workers = 0
        self.sampler = None

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)

    def __len__(self) -> int:
        return len(self.dataset)


def to_numpy(element: Any) -> Any:
    """An element as tf's ``as_numpy_iterator`` yields it: tensors as numpy arrays (a scalar
    as a numpy scalar, e.g. ``np.int64``), text as ``bytes`` (``str`` encoded as UTF-8; a text
    array as an object array of ``bytes``)."""
    return map_structure(_leaf_to_numpy, element)


def _leaf_to_numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        arr = x.detach().cpu().numpy()
        return arr[()] if arr.ndim == 0 else arr
    if isinstance(x, str):
        return x.encode()
    if isinstance(x, np.str_):
        return str(x).encode()
    if isinstance(x, np.ndarray) and x.dtype.kind in "UO":
        out = np.empty(x.shape, dtype=object)
        out.reshape(-1)[:] = [v.encode() if isinstance(v, str) else v for v in x.reshape(-1)]
        return out
    return x
