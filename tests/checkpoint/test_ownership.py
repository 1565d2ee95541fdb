"""A checkpoint directory is owned (one writer; a dead writer's lock and leftovers are taken
over, a live one's never touched), a failed save leaves nothing, and reading is safe (plain
files inside the checkpoint only, sizes before bytes, hashes before decoding, validation before
any assignment)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from stratagem.core.procs import start_time
from stratagem.train.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointDirectoryLockedError,
    CheckpointManager,
)
from stratagem.train.checkpoint.files import _canonical
from stratagem.train.checkpoint.lock import LOCK_NAME


def _model(out: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, out))


def _manager(tmp_path, **objects):
    model = objects.pop("model", None) or _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return CheckpointManager(Checkpoint(model=model, optimizer=opt, **objects), tmp_path), model, opt


@pytest.fixture
def other_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(0.2)
    yield p
    p.kill()
    p.wait()


def _hold(directory, pid, host=None):
    (directory / LOCK_NAME).write_text(json.dumps({
        "host": host or socket.gethostname(), "pid": pid, "started": start_time(pid),
        "token": "someone-else", "since": time.time(),
    }))  # fmt: skip


def test_a_live_writer_holds_the_directory_and_a_dead_one_is_taken_over(tmp_path, other_process):
    manager, _, _ = _manager(tmp_path)
    _hold(tmp_path, other_process.pid)
    with pytest.raises(CheckpointDirectoryLockedError, match=f"in use by another writer: pid {other_process.pid} on host"):
        manager.save(1)
    assert manager.checkpoints == []
    other_process.kill()
    other_process.wait()
    assert manager.save(1).endswith("ckpt-1")  # the dead holder's lock is taken over
    manager.close()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_holder_on_another_host_is_named_with_what_to_do(tmp_path):
    manager, _, _ = _manager(tmp_path)
    _hold(tmp_path, 12345, host="some-other-machine")
    with pytest.raises(CheckpointDirectoryLockedError, match="some-other-machine.*once that job has ended, delete the lock file"):
        manager.restore_or_initialize()


@pytest.mark.slow
def test_the_lock_is_released_at_exit(tmp_path):
    code = (
        "import torch; from torch import nn; from stratagem.train.checkpoint import Checkpoint, CheckpointManager;"
        f"m = nn.Linear(2, 2); CheckpointManager(Checkpoint(model=m), {str(tmp_path)!r}).save(1)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert (tmp_path / "ckpt-1").is_dir() and not (tmp_path / LOCK_NAME).exists()


def test_a_failed_save_removes_its_own_files_and_later_saves_work(tmp_path):
    manager, model, _ = _manager(tmp_path)
    first = manager.save(1)

    def disk_full(name):
        if name == "shared.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device")

    manager._on_file_written = disk_full
    with pytest.raises(RuntimeError, match="could not write the checkpoint at step 2.*No space left on device"):
        manager.save(2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME) == ["ckpt-1"]
    manager._on_file_written = None
    assert manager.save(3).endswith("ckpt-3")
    assert manager.checkpoints == [first, str(tmp_path / "ckpt-3")]


def test_a_value_that_cannot_be_encoded_fails_cleanly(tmp_path):
    class Odd:
        def state_dict(self):
            return {"x": object()}

        def load_state_dict(self, s):
            pass

    manager, _, _ = _manager(tmp_path, odd=Odd())
    with pytest.raises(RuntimeError, match="cannot checkpoint odd.x"):
        manager.save(1)
    assert [p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME] == []


def test_cleanup_touches_only_this_writer_and_dead_writers(tmp_path, other_process):
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    live = tmp_path / f".tmp-ckpt-7+{host}+{other_process.pid}+abcd1234"
    gone = tmp_path / f".tmp-ckpt-7+{host}+{dead_pid}+abcd1234"
    remote = tmp_path / f".tmp-ckpt-7+elsewhere+{dead_pid}+abcd1234"
    aside = tmp_path / f".old-ckpt-5+{host}+{dead_pid}+abcd1234"  # its replacement never landed
    pruning = tmp_path / f".del-ckpt-3+{host}+{dead_pid}+abcd1234"  # stopped while removing it
    for d in (live, gone, remote, aside, pruning):
        d.mkdir()
    (aside / "metadata.json").write_text("{}")
    manager, _, _ = _manager(tmp_path)
    manager.save(1)
    names = {p.name for p in tmp_path.iterdir()}
    assert live.name in names and remote.name in names  # a live writer's, another host's: kept
    assert gone.name not in names and pruning.name not in names  # a dead writer's: removed
    assert "ckpt-3" not in names  # one being pruned is never put back
    assert (tmp_path / "ckpt-5" / "metadata.json").exists()  # set aside by a dead writer: recovered


def test_pruning_never_shows_a_half_deleted_checkpoint(tmp_path):
    manager = CheckpointManager(Checkpoint(model=_model()), tmp_path, max_to_keep=1)
    manager.save(1)
    manager.save(2)  # ckpt-1 is renamed away, then removed
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME) == ["ckpt-2"]


# --- safe reading ---------------------------------------------------------------------------------
def _tamper(ckpt, edit):
    meta = json.loads((ckpt / "metadata.json").read_text())
    meta.pop("sha256")
    edit(meta)
    meta["sha256"] = hashlib.sha256(_canonical(meta)).hexdigest()
    (ckpt / "metadata.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("target", ["outside", "absolute", "fifo", "device", "symlink"])
def test_tampered_metadata_is_refused_quickly(tmp_path, target):
    manager, _, _ = _manager(tmp_path / "run")
    ckpt = tmp_path / "run" / "ckpt-1"
    manager.save(1)
    info = json.loads((ckpt / "metadata.json").read_text())["files"]["shared.safetensors"]
    if target == "outside":
        (tmp_path / "evil.safetensors").write_bytes(b"x")
        _tamper(ckpt, lambda m: m["files"].update({"../evil.safetensors": info}))
    elif target == "absolute":
        _tamper(ckpt, lambda m: m["files"].update({"/dev/zero": info}))
    elif target == "fifo":
        os.remove(ckpt / "shared.safetensors")
        os.mkfifo(ckpt / "shared.safetensors")
    elif target == "device":
        os.remove(ckpt / "shared.safetensors")
        os.symlink("/dev/zero", ckpt / "shared.safetensors")
    else:
        os.remove(ckpt / "shared.json")
        os.symlink(tmp_path / "run" / "ckpt-1" / "rank-0.json", ckpt / "shared.json")
    start = time.monotonic()
    with pytest.raises(CheckpointCorruptError) as e:
        manager.restore(ckpt)
    assert time.monotonic() - start < 5.0  # promise: refused without a read of a FIFO or a device file, which would block of a FIFO or a device file, which would block
    want = {
        "outside": "not a plain name inside the checkpoint directory",
        "absolute": "not a plain name inside the checkpoint directory",
        "fifo": "it is a FIFO",
        "device": "symbolic link",
        "symlink": "symbolic link",
    }[target]
    assert want in str(e.value)


def test_a_failed_restore_changes_nothing(tmp_path):
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, s):
            self.n = s["n"]

    saver, _, _ = _manager(tmp_path, counter=Counter())
    saver.checkpoint.counter.n = 5
    saver.save(1)
    saver.close()
    # same first layer, another last layer: the old restore loaded layer 0 before failing
    model = _model(out=2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    counter = Counter()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager = CheckpointManager(Checkpoint(model=model, optimizer=opt, counter=counter), tmp_path)
    with pytest.raises(ValueError, match=r"model'?s? ?.*1\.weight.*shape \(3, 8\).*\(2, 8\)"):
        manager.restore(tmp_path / "ckpt-1")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"] == {} and counter.n == 0


def test_a_failing_object_is_rolled_back(tmp_path):
    class Box:
        def __init__(self, v, fail=False):
            self.v, self.fail = v, fail

        def state_dict(self):
            return {"v": self.v}

        def load_state_dict(self, s):
            if self.fail:
                raise RuntimeError("this object refuses its state")
            self.v = s["v"]

    ckpt = Checkpoint(a=Box(1), b=Box(2))
    m = CheckpointManager(ckpt, tmp_path)
    m.save(1)
    a, b = Box(10), Box(20, fail=True)
    with pytest.raises(RuntimeError, match="refuses"):
        CheckpointManager(Checkpoint(a=a, b=b), tmp_path).restore(tmp_path / "ckpt-1")
    assert (a.v, b.v) == (10, 20)


def test_an_object_array_in_the_json_is_refused():
    from stratagem.train.checkpoint.codec import decode_value

    with pytest.raises(CheckpointCorruptError, match="dtype object"):
        decode_value({"__ndarray__": {"dtype": "|O", "shape": [1], "data": [1]}}, {}, "rank-0.json")
