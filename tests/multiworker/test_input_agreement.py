"""Replicas agree on every global batch's shapes, in the per-step vote (no extra collective)."""

from __future__ import annotations

import pytest
from mw_workers import first_batch_worker, shapes_worker

from stratagem.testing import run_workers


@pytest.mark.timeout(120)
def test_a_later_global_batch_of_another_shape_is_an_error_on_every_replica():
    results = run_workers(shapes_worker, 2, args=(3,), timeout=90, check=False)
    for r in results:
        assert r.returncode == 1, r.stderr[-2000:]
        assert "global batch 3 has different structures, shapes or dtypes on different replicas" in r.stderr, r.stderr[-2000:]
        assert "replica 0: float32[4,3]" in r.stderr and "replica 1: float32[4,2]" in r.stderr, r.stderr[-2000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "via, message",
    [
        ("distribute", "the dataset yielded different first global batches on different replicas"),
        ("fit", "the dataset gave different first global batches on different replicas"),
    ],
)
def test_differently_shuffled_first_batches_are_an_error_on_every_replica(via, message):
    """Same shapes, other rows (each replica's shuffle seeded differently): without this check
    each replica would train on its slice of another permutation: examples seen twice or never."""
    results = run_workers(first_batch_worker, 2, args=(via,), timeout=90, check=False)
    for r in results:
        assert r.returncode == 1, r.stderr[-2000:]
        assert "ReplicaMismatchError: " + message in r.stderr, r.stderr[-2000:]
        assert "seed any shuffling" in r.stderr, r.stderr[-2000:]
