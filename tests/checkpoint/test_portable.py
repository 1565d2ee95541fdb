"""Portable checkpoints: one written by 2 replicas loads into a plain process (no strategy), into
a plain nn.Module with one call, and into a job of 3 replicas, and training goes on with
single-device parity (the same global batches)."""

from __future__ import annotations

import pytest
import torch
from ckpt_workers import portable_model, portable_train, portable_worker

from stratagem.testing import run_workers
from stratagem.train.checkpoint import (
    Checkpoint,
    CheckpointManager,
    export_safetensors,
    load_state_dict,
)

K, M = 4, 3


def _reference(steps: int) -> dict[str, torch.Tensor]:
    model = portable_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    portable_train(model, opt, range(steps))
    return model.state_dict()


def _close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.timeout(240)
def test_two_replicas_to_one_process_to_a_module_and_to_three_replicas(tmp_path):
    two = run_workers(portable_worker, 2, args=(str(tmp_path), 0, K, False), timeout=120)
    _close(two[0].value["params"], _reference(K))  # mirrored training == single device

    # 1. a plain nn.Module, one call, no strategy, no process group
    plain = portable_model()
    plain.load_state_dict(load_state_dict(tmp_path))  # the directory: its newest checkpoint
    _close(plain.state_dict(), two[0].value["params"])
    out = export_safetensors(tmp_path / f"ckpt-{K}", tmp_path / "weights.safetensors")
    import safetensors.torch

    _close(safetensors.torch.load_file(out), two[0].value["params"])

    # 2. a plain script with no strategy: model + optimizer restore, training goes on
    model = portable_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = CheckpointManager(Checkpoint(model=model, optimizer=opt), tmp_path)
    assert manager.restore_or_initialize().endswith(f"ckpt-{K}")
    manager.close()
    portable_train(model, opt, range(K, K + M))
    _close(model.state_dict(), _reference(K + M))

    # 3. a job of 3 replicas: restores the 2-replica checkpoint and goes on with parity
    three = run_workers(portable_worker, 3, args=(str(tmp_path), K, K + M, True), timeout=150,
                        allow_stderr=[("keep their own 'rng'", "the warning this restore is meant to give")])
    for r in three:
        assert r.value["restored"].endswith(f"ckpt-{K}")
        _close(r.value["params"], _reference(K + M))
    # replica 2 has no saved RNG streams: it keeps its own, and the job says so once (rank 0)
    assert "replicas 2..2 of 3 keep their own 'rng'" in three[0].stderr
    assert "'rng'" not in three[1].stderr + three[2].stderr


def _two_replica_checkpoint(directory, per_replica):
    """A checkpoint as 2 replicas write it: per-replica states in rank-0 and rank-1."""
    from stratagem.train.checkpoint.codec import encode_value
    from stratagem.train.checkpoint.files import _payload, write_checkpoint

    parts = []
    for state in per_replica:
        tensors = {}
        parts.append(_payload({k: encode_value(v, tensors, k) for k, v in state.items()}, tensors))
    write_checkpoint(directory, 5, _payload({}, {}), parts)


def test_data_position_into_another_replica_count(tmp_path):
    from stratagem.comm import LocalCommunicator
    from stratagem.data import Dataset
    from stratagem.distribute.engines.input import DistributedDataset

    # the iterator of experimental_distribute_dataset reads the global batches on every replica:
    # its position carries over exactly to any number of replicas
    dist = DistributedDataset(Dataset.range(20).batch(4), LocalCommunicator(), None)
    it = dist.iterator(epoch=0)
    next(it), next(it)
    _two_replica_checkpoint(tmp_path, [{"data": it.state_dict()}, {"data": it.state_dict()}])
    fresh = dist.iterator(epoch=0)
    CheckpointManager(Checkpoint(data=fresh), tmp_path).restore(tmp_path / "ckpt-5")
    assert next(fresh).tolist() == [8, 9, 10, 11]

    # a per-replica position (each replica's own shard) cannot be mapped: named, nothing changed
    class Shard:
        def __init__(self):
            self.pos = 0

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, s):
            self.pos = s["pos"]

    (tmp_path / "b").mkdir()
    _two_replica_checkpoint(tmp_path / "b", [{"shard": {"pos": 3}}, {"shard": {"pos": 4}}])
    shard = Shard()
    with pytest.raises(ValueError, match="written by 2 processes; this job has 1. 'shard' .*leave 'shard' out"):
        CheckpointManager(Checkpoint(shard=shard), tmp_path / "b").restore(tmp_path / "b" / "ckpt-5")
    assert shard.pos == 0
