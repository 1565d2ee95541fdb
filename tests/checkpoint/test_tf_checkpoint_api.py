"""TensorFlow's own checkpoint calls (issue 30), written as the tutorials write them:
``checkpoint.save(checkpoint_prefix)`` numbering its saves ``ckpt-1``, ``ckpt-2``, ... by
``save_counter``, ``checkpoint.restore(tf.train.latest_checkpoint(checkpoint_dir))`` with its
status object, and ``CheckpointManager.save()`` without a number (TensorFlow counts the saves).
Under a strategy every replica calls them and the chief writes; the restored model equals the
one trained on a single device."""

from __future__ import annotations

import os

import pytest
import torch
from ckpt_workers import FAST, portable_model, portable_train
from torch import nn

import stratagem as sg
from stratagem.cluster.resolvers import TorchrunClusterResolver
from stratagem.distribute.strategies.multi_worker import MultiWorkerMirroredStrategy
from stratagem.testing import run_workers


def _trained(steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = portable_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    portable_train(model, optimizer, range(steps))
    return model, optimizer


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_save_prefix_numbers_by_save_counter_and_restore_latest(tmp_path):
    checkpoint_dir = str(tmp_path / "training_checkpoints")
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")
    model, optimizer = _trained(0)
    checkpoint = sg.Checkpoint(optimizer=optimizer, model=model)
    assert int(checkpoint.save_counter) == 0

    saved = []
    for epoch in range(4):
        portable_train(model, optimizer, range(epoch, epoch + 1))
        if epoch % 2 == 0:
            saved.append(checkpoint.save(checkpoint_prefix))
    assert saved == [checkpoint_prefix + "-1", checkpoint_prefix + "-2"]  # tf's names
    assert int(checkpoint.save_counter) == 2
    assert sg.train.latest_checkpoint(checkpoint_dir) == checkpoint_prefix + "-2"

    # the state after epoch 2 (the second save), trained again from scratch
    want_model, want_opt = _trained(3)

    new_model = portable_model()
    new_optimizer = torch.optim.Adam(new_model.parameters(), lr=0.01)
    checkpoint = sg.Checkpoint(optimizer=new_optimizer, model=new_model)
    status = checkpoint.restore(sg.train.latest_checkpoint(checkpoint_dir))
    assert status.assert_consumed() is status
    status.assert_existing_objects_matched().expect_partial()
    _same(new_model.state_dict(), want_model.state_dict())
    assert new_optimizer.state_dict()["state"][0]["step"] == want_opt.state_dict()["state"][0]["step"] == 3
    assert torch.equal(new_optimizer.state_dict()["state"][0]["exp_avg"], want_opt.state_dict()["state"][0]["exp_avg"])
    # tf restores save_counter with the checkpoint: the next save is ckpt-3
    assert int(checkpoint.save_counter) == 2
    assert checkpoint.save(checkpoint_prefix) == checkpoint_prefix + "-3"
    # an earlier one restores too (the path tf's save returned)
    checkpoint.restore(saved[0]).assert_consumed()
    assert int(checkpoint.save_counter) == 1
    assert not torch.equal(new_model[0].weight, want_model[0].weight)


def test_save_writes_tf_state_file_so_a_rerun_is_the_latest(tmp_path):
    prefix = str(tmp_path / "ckpt")
    model, optimizer = _trained(1)
    first = sg.Checkpoint(model=model, optimizer=optimizer)
    first.save(prefix)
    first.save(prefix)
    # a second run of the program in the same directory: tf's counter starts again at 1 and
    # tf.train.latest_checkpoint reads the state file, so ckpt-1 of this run is the newest
    portable_train(model, optimizer, range(1, 2))
    rerun = sg.Checkpoint(model=model, optimizer=optimizer)
    assert rerun.save(prefix) == prefix + "-1"
    assert (tmp_path / "checkpoint").read_text().splitlines()[0] == 'model_checkpoint_path: "ckpt-1"'
    assert sg.train.latest_checkpoint(str(tmp_path)) == prefix + "-1"
    fresh = portable_model()
    sg.Checkpoint(model=fresh).restore(prefix + "-1").expect_partial()
    _same(fresh.state_dict(), model.state_dict())


def test_other_prefix_and_load_weights(tmp_path):
    model, optimizer = _trained(2)
    path = sg.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "run" / "model"))
    assert path == str(tmp_path / "run" / "model-1")
    assert sg.train.latest_checkpoint(str(tmp_path / "run")) == path
    fresh = sg.train.load_weights(portable_model(), path)  # model.load_weights(path)
    _same(fresh.state_dict(), model.state_dict())


def test_restore_status_assertions(tmp_path):
    model, optimizer = _trained(1)
    path = sg.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
    fresh = portable_model()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    # no checkpoint yet: tf's restore(None) restores nothing, and assert_consumed says so
    status = sg.Checkpoint(model=fresh).restore(None)
    with pytest.raises(AssertionError, match="No checkpoint specified"):
        status.assert_consumed()
    _same(fresh.state_dict(), before)
    # only the model restored: the optimizer saved in the checkpoint is not consumed
    status = sg.Checkpoint(model=fresh).restore(path)
    _same(fresh.state_dict(), model.state_dict())
    with pytest.raises(AssertionError, match=r"\['optimizer'\]"):
        status.assert_consumed()
    assert status.expect_partial() is status
    # a Checkpoint with an object the checkpoint lacks: an error, nothing restored
    other = portable_model()
    ckpt = sg.Checkpoint(model=other, extra=nn.Linear(2, 2))
    with pytest.raises(KeyError, match="no state for"):
        ckpt.restore(path)
    with pytest.raises(ValueError, match="save_counter"):
        sg.Checkpoint(save_counter=torch.tensor(0))


def test_manager_save_without_number_counts_saves(tmp_path):
    model, optimizer = _trained(1)
    checkpoint = sg.Checkpoint(optimizer=optimizer, model=model)
    manager = sg.CheckpointManager(checkpoint, str(tmp_path / "tf_ckpts"), max_to_keep=3)
    assert checkpoint.restore(manager.latest_checkpoint).expect_partial() is not None  # none yet
    paths = [manager.save() for _ in range(4)]
    assert [os.path.basename(p) for p in paths] == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4"]
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-2", "ckpt-3", "ckpt-4"]
    assert int(checkpoint.save_counter) == 4
    assert manager.save(10).endswith("ckpt-10")  # an explicit number still counts as a save
    assert int(checkpoint.save_counter) == 5

    # the training-checkpoints guide: restore the latest, then keep saving where it left off
    fresh = portable_model()
    opt2 = torch.optim.Adam(fresh.parameters(), lr=0.01)
    ckpt2 = sg.Checkpoint(optimizer=opt2, model=fresh)
    manager2 = sg.CheckpointManager(ckpt2, str(tmp_path / "tf_ckpts"), max_to_keep=3)
    ckpt2.restore(manager2.latest_checkpoint).assert_consumed()
    assert manager2.latest_checkpoint.endswith("ckpt-10") and int(ckpt2.save_counter) == 10
    _same(fresh.state_dict(), model.state_dict())
    assert manager2.save().endswith("ckpt-11")


# --- under a strategy: 2 processes, collective save and restore --------------------------------------
def tutorial_worker(checkpoint_dir: str) -> dict:
    strategy = MultiWorkerMirroredStrategy(TorchrunClusterResolver(), FAST, devices="cpu")
    rank, world = strategy.extended.replica_id, strategy.num_replicas_in_sync
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")
    with strategy.scope():
        model = portable_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        checkpoint = sg.Checkpoint(optimizer=optimizer, model=model)
    saved = []
    for epoch in range(4):
        portable_train(model, optimizer, range(epoch, epoch + 1), lambda f, args: strategy.run(f, args=args), rank, world)
        if epoch % 2 == 0:
            saved.append(checkpoint.save(checkpoint_prefix))  # every replica; the chief writes
    latest = sg.train.latest_checkpoint(checkpoint_dir)
    # the tutorial's restore: a new model and optimizer outside the strategy
    new_model = portable_model()
    new_optimizer = torch.optim.Adam(new_model.parameters(), lr=0.01)
    sg.Checkpoint(optimizer=new_optimizer, model=new_model).restore(latest).assert_consumed()
    # and inside it (collective)
    with strategy.scope():
        in_scope = portable_model()
        opt3 = torch.optim.Adam(in_scope.parameters(), lr=0.01)
        ckpt3 = sg.Checkpoint(optimizer=opt3, model=in_scope)
    ckpt3.restore(latest).assert_consumed()
    return {
        "saved": saved,
        "latest": latest,
        "counter": int(checkpoint.save_counter),
        "restored": {k: v.clone() for k, v in new_model.state_dict().items()},
        "in_scope": {k: v.clone() for k, v in in_scope.state_dict().items()},
        "in_scope_counter": int(ckpt3.save_counter),
    }


@pytest.mark.timeout(120)
def test_save_and_restore_under_a_strategy_match_one_device(tmp_path):
    results = run_workers(tutorial_worker, 2, args=(str(tmp_path),), timeout=100)
    want, _ = _trained(3)  # the same global batches on one device, up to the second save
    prefix = os.path.join(str(tmp_path), "ckpt")
    for r in results:
        v = r.value
        assert v["saved"] == [prefix + "-1", prefix + "-2"]
        assert v["latest"] == prefix + "-2" and v["counter"] == 2 and v["in_scope_counter"] == 2
        for key in ("restored", "in_scope"):
            for k, t in want.state_dict().items():
                torch.testing.assert_close(v[key][k], t, rtol=1e-5, atol=1e-6)
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["checkpoint", "ckpt-1", "ckpt-2"]
