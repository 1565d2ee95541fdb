"""The checkpoint mistakes users make, answered at once: steps that are not non-negative ints,
``latest`` after falling back past a broken checkpoint, a directory that is a file (issue 53)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from stratagem.train.checkpoint import Checkpoint, CheckpointManager


def _manager(tmp_path: Path, **kw) -> CheckpointManager:
    torch.manual_seed(0)
    return CheckpointManager(Checkpoint(model=nn.Linear(3, 2)), tmp_path / "ckpts", **kw)


@pytest.mark.parametrize(
    "step, error, words",
    [
        (-1, ValueError, r"got -1: it would be written as ckpt--1, which restore_or_initialize never finds"),
        (2.5, TypeError, r"non-negative int, got 2\.5 \(float\)"),
        (3.0, TypeError, r"got 3\.0 \(float\) \(pass int\(3\.0\)"),
        (True, TypeError, r"got True \(bool\)"),
        ("3", TypeError, r"got '3' \(str\)"),
        (torch.tensor(2.5), TypeError, r"torch\.float32 tensor"),
        (torch.tensor([1, 2]), TypeError, r"shape \(2,\)"),
        (torch.tensor(-2), ValueError, r"got -2"),
    ],
    ids=["negative", "fraction", "whole-float", "bool", "str", "float-tensor", "two-elements", "negative-tensor"],
)
def test_a_step_that_is_not_a_non_negative_int_is_an_error_and_nothing_is_written(tmp_path, step, error, words):
    manager = _manager(tmp_path)
    with pytest.raises(error, match=words):
        manager.save(step)
    assert manager.checkpoints == [] and int(manager.checkpoint.save_counter) == 0


def test_a_step_object_that_is_negative_is_an_error_too(tmp_path):
    manager = CheckpointManager(Checkpoint(model=nn.Linear(3, 2), step=torch.tensor(-1)), tmp_path)
    with pytest.raises(ValueError, match="ckpt--1"):
        manager.save()


@pytest.mark.parametrize("step", [0, 7, np.int64(4), torch.tensor(5), torch.tensor(6, dtype=torch.int32)])
def test_non_negative_whole_steps_of_any_integer_kind_are_saved(tmp_path, step):
    manager = _manager(tmp_path)
    path = manager.save(step)
    assert Path(path).name == f"ckpt-{int(step)}"
    assert manager.latest == path


def test_latest_names_the_checkpoint_restored_after_falling_back_past_a_broken_one(tmp_path):
    manager = _manager(tmp_path)
    first = manager.save(1)
    newest = manager.save(2)
    (Path(newest) / "shared.safetensors").write_bytes(b"broken")
    assert manager.latest == newest  # not verified yet
    again = _manager(tmp_path)  # a resumed job
    with pytest.warns(UserWarning, match="skipping checkpoint .*ckpt-2"):
        restored = again.restore_or_initialize()
    assert restored == first
    assert again.latest == first and again.latest_checkpoint == first
    assert again.checkpoints == [first]
    # writing that step again makes it the newest once more
    assert again.save(2) == newest and again.latest == newest
    assert again.checkpoints == [first, newest]


def test_a_checkpoint_directory_that_is_a_file_is_a_clear_error(tmp_path):
    file = tmp_path / "weights"
    file.write_text("not a directory")
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"CheckpointManager: the checkpoint directory .*weights is a file, not a directory"):
        CheckpointManager(Checkpoint(model=model), file)
    with pytest.raises(ValueError, match=r"weights/run lies inside .*weights, which is a file"):
        CheckpointManager(Checkpoint(model=model), file / "run")
    with pytest.raises(ValueError, match=r"Checkpoint\.save\(.*weights/ckpt'\): the checkpoint directory .*weights is a file"):
        Checkpoint(model=model).save(file / "ckpt")
    assert file.read_text() == "not a directory"
