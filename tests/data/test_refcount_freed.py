"""Batches are freed when the loop lets go of them, not when Python's garbage collector runs.

A batch caught in a reference cycle (a self-calling closure over its leaves, an iterator state
pointing back at its owner) stays in memory until the collector's next pass: with large
batches, or shared memory freed by a finalizer, that is a memory spike and work done at a
moment no replica agrees on. Each pipeline here runs with the collector off; every batch must
be gone as soon as the loop drops it.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch

from stratagem.data import Dataset


def _xy(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n * 3, dtype=torch.float32).reshape(n, 3), torch.arange(n)


def _double(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, y


def _as_dict(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"x": x, "y": y}


def _ragged(i: torch.Tensor) -> torch.Tensor:
    return torch.ones(int(i) % 4 + 1)


def _gen():
    for i in range(20):
        yield np.full((2,), i, dtype=np.float32)


PIPELINES: dict[str, Callable[[str], Dataset]] = {
    "slices-batch": lambda tmp: Dataset.from_tensor_slices(_xy()).batch(4),
    "map-threads": lambda tmp: Dataset.from_tensor_slices(_xy()).map(_double, num_parallel_calls=2).batch(4),
    "dict-shuffle-prefetch": lambda tmp: Dataset.from_tensor_slices(_xy()).map(_as_dict).shuffle(8, seed=1).batch(5).prefetch(2),
    "padded": lambda tmp: Dataset.range(12).map(_ragged).padded_batch(3),
    "generator": lambda tmp: Dataset.from_generator(_gen).batch(3),
    "cache-file": lambda tmp: Dataset.from_tensor_slices(_xy()).cache(f"{tmp}/c").batch(4),
    "saved": lambda tmp: _saved(tmp),
    "map-processes": lambda tmp: Dataset.from_tensor_slices(_xy()).map(_double, num_parallel_calls=2, use_processes=True).batch(4),
}


def _saved(tmp: str) -> Dataset:
    Dataset.from_tensor_slices(_xy()).save(f"{tmp}/saved")
    return Dataset.load(f"{tmp}/saved").batch(4)


def _leaves(batch) -> list[torch.Tensor]:
    if isinstance(batch, dict):
        return [v for k in sorted(batch) for v in _leaves(batch[k])]
    if isinstance(batch, tuple | list):
        return [v for b in batch for v in _leaves(b)]
    return [batch] if isinstance(batch, torch.Tensor) else []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_each_batch_is_freed_as_soon_as_the_loop_drops_it(name, tmp_path):
    ds = PIPELINES[name](str(tmp_path))
    for _ in ds:  # a first pass writes caches and starts whatever is lazy
        pass
    gc.collect()
    gc.disable()
    try:
        held: list[weakref.ref] = []
        seen = 0
        for batch in ds:
            leaves = _leaves(batch)
            assert leaves, f"{name}: a batch without tensors: {batch!r}"
            held.extend(weakref.ref(t) for t in leaves)
            seen += 1
            del batch, leaves
        alive = sum(r() is not None for r in held)
        assert seen > 2 and alive == 0, f"{name}: {alive} of {len(held)} batch tensors outlived their step"
    finally:
        gc.enable()
