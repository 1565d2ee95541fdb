"""A sharded checkpoint is one directory every process writes: a save that cannot make it whole
fails on every replica and keeps nothing (it used to commit the chief's part as the checkpoint,
found incomplete only when restored)."""

from __future__ import annotations

import os

import pytest
from ckpt_workers import sharded_save_worker

from stratagem.testing import run_workers


@pytest.mark.timeout(120)
def test_tensorflow_per_worker_directories_are_an_error_before_anything_is_written(tmp_path):
    results = run_workers(sharded_save_worker, 2, args=(str(tmp_path), "tf_idiom"), timeout=90)
    for r in results:
        assert r.value["error"].startswith("ValueError: a sharded checkpoint is one directory"), r.value
        assert "replica 1: " + str(tmp_path / "workertemp_1" / "ckpt") in r.value["error"], r.value
        assert "pass every worker the same directory" in r.value["error"], r.value
    assert results[0].value["chief_sees"] is None  # nothing made, not even the directory


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root")
def test_a_directory_not_on_shared_storage_is_an_error_and_nothing_is_kept(tmp_path):
    results = run_workers(sharded_save_worker, 2, args=(str(tmp_path), "unshared"), timeout=90)
    for r in results:
        assert r.value["error"].startswith("RuntimeError: the sharded checkpoint directory"), r.value
        assert "is not shared: the chief does not see the files other processes wrote" in r.value["error"], r.value
        assert "replica 1: " in r.value["error"] and "replica 0" not in r.value["error"], r.value
    assert results[0].value["left"] == []  # the chief's part removed, nothing committed
    assert results[1].value["left"] == []  # replica 1's own part removed from its filesystem
