"""Checkpoint files: round trip, atomic commit, corrupted/truncated files refused, pickle never run."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_workers import kill_during_write, make_model

from stratagem.data import Dataset
from stratagem.testing import run_workers
from stratagem.train.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointManager,
    RNGState,
    verify,
)


def _trained(seed=0, steps=3):
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    return model, opt


def test_round_trip_model_optimizer_iterator_rng_step(tmp_path):
    model, opt = _trained()
    it = iter(Dataset.range(100).shuffle(20, seed=1).batch(4))
    for _ in range(3):
        next(it)
    step = torch.tensor(3)
    manager = CheckpointManager(
        Checkpoint(model=model, optimizer=opt, data=it, rng=RNGState(), step=step, epoch=2), tmp_path
    )
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    path = manager.save(step)
    expect = (torch.rand(3), random.random(), np.random.rand(), next(it))
    want_params = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = opt.state_dict()

    model2, opt2 = _trained(seed=9, steps=1)
    it2 = iter(Dataset.range(100).shuffle(20, seed=1).batch(4))
    step2 = torch.tensor(0)
    ckpt2 = Checkpoint(model=model2, optimizer=opt2, data=it2, rng=RNGState(), step=step2, epoch=0)
    CheckpointManager(ckpt2, tmp_path).restore(path)
    assert int(step2) == 3 and ckpt2.epoch == 2
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want_params[k]), k
    got_opt = opt2.state_dict()
    assert got_opt["param_groups"] == want_opt["param_groups"]
    for i, s in want_opt["state"].items():
        for k, v in s.items():
            assert torch.equal(got_opt["state"][i][k], v), (i, k)
    assert torch.equal(torch.rand(3), expect[0])
    assert random.random() == expect[1] and np.random.rand() == expect[2]
    assert np.array_equal(next(it2), expect[3])  # the data iterator resumes where it was


def test_manager_keeps_max_to_keep_and_lists_latest(tmp_path):
    model, _ = _trained()
    manager = CheckpointManager(Checkpoint(model=model), tmp_path, max_to_keep=2)
    for s in (1, 2, 3):
        manager.save(s)
    assert [Path(p).name for p in manager.checkpoints] == ["ckpt-2", "ckpt-3"]
    assert manager.latest is not None and manager.latest.endswith("ckpt-3")
    files = sorted(os.listdir(manager.latest))
    assert files == ["metadata.json", "rank-0.json", "rank-0.safetensors", "shared.json", "shared.safetensors"]


def _setup(tmp_path):
    model, opt = _trained()
    manager = CheckpointManager(Checkpoint(model=model, optimizer=opt), tmp_path)
    manager.save(1)
    manager.step1 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    manager.save(2)
    return model, opt, manager


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_file_is_refused_and_previous_checkpoint_used(tmp_path, damage):
    model, opt, manager = _setup(tmp_path)
    target = Path(manager.latest) / "shared.safetensors"
    data = target.read_bytes()
    if damage == "flip":
        target.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    elif damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    else:
        target.unlink()
    with pytest.raises(CheckpointCorruptError, match="shared.safetensors") as info:
        manager.restore(manager.latest)
    assert {"flip": "sha256", "truncate": "truncated", "delete": "missing"}[damage] in info.value.problem
    with pytest.warns(UserWarning, match="skipping checkpoint .*ckpt-2"):
        restored = manager.restore_or_initialize()
    assert restored is not None and restored.endswith("ckpt-1")
    for k, v in model.state_dict().items():
        assert torch.equal(v, manager.step1[k]), k


def test_edited_metadata_is_refused(tmp_path):
    _, _, manager = _setup(tmp_path)
    meta = Path(manager.latest) / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["step"] = 99
    meta.write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match="metadata.json.*sha256"):
        verify(manager.latest)


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("victim", ["shared.safetensors", "shared.json", "metadata.json"])
def test_pickle_payload_is_never_executed(tmp_path, victim):
    """Replace a file with a pickle that would create a marker file, and make the checksums
    agree (an attacker who can write the directory can do that): loading refuses it."""
    _, _, manager = _setup(tmp_path / "ckpts")
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Marker(str(marker)))
    ckpt = Path(manager.latest)
    (ckpt / victim).write_bytes(payload)
    if victim != "metadata.json":
        import hashlib

        doc = json.loads((ckpt / "metadata.json").read_text())
        doc["files"][victim] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
        body = {k: v for k, v in doc.items() if k != "sha256"}
        doc["sha256"] = hashlib.sha256(
            json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
        (ckpt / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match=victim):
        manager.restore(str(ckpt))
    assert not marker.exists()
    # the sanity check of the test itself: unpickling it *would* create the marker
    pickle.loads(payload).close()
    assert marker.exists()


def test_unsupported_state_is_named():
    class Weird:
        def state_dict(self):
            return {"f": object()}

        def load_state_dict(self, s):
            pass

    ckpt = Checkpoint(weird=Weird())
    with pytest.raises(TypeError, match=r"cannot checkpoint weird\.f: a object"):
        ckpt.encode(shared=False)
    with pytest.raises(TypeError, match="has no state_dict"):
        Checkpoint(thing=object())


@pytest.mark.timeout(90)
def test_killed_during_write_resumes_from_previous(tmp_path):
    results = run_workers(kill_during_write, 1, args=(str(tmp_path),), timeout=60, check=False)
    assert results[0].returncode == -9, results[0].stderr[-2000:]
    names = sorted(os.listdir(tmp_path))
    assert "ckpt-1" in names and "ckpt-2" not in names  # step 2 never committed
    assert any(n.startswith(".tmp-ckpt-2") for n in names)  # its partial files are set aside
    torch.manual_seed(0)
    model = make_model()
    manager = CheckpointManager(Checkpoint(model=model, optimizer=torch.optim.Adam(model.parameters())), tmp_path)
    assert manager.latest is not None and manager.latest.endswith("ckpt-1")
    assert manager.restore_or_initialize().endswith("ckpt-1")
    manager.save(3)  # the next save clears the partial directory
    assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))


def test_restore_or_initialize_without_checkpoints_leaves_objects(tmp_path):
    model, _ = _trained()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert CheckpointManager(Checkpoint(model=model), tmp_path / "none").restore_or_initialize() is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
