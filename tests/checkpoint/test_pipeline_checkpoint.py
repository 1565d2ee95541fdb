"""Checkpoints under PipelineStrategy: every stage saves its own layers; resume is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipe_ckpt_workers import pipeline_checkpoint_worker

from stratagem.testing import run_workers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble", "interleaved_1f1b"])  # interleaved: 2 chunks a stage
def test_pipeline_stages_checkpoint_and_resume_exactly(tmp_path, schedule):
    r0, r1 = (r.value for r in run_workers(pipeline_checkpoint_worker, 2, args=(str(tmp_path), schedule)))
    assert r0["names"] == ["0.bias", "0.weight"] and r1["names"] == ["3.bias", "3.weight"]
    assert r0["same"] and r1["same"] and r0["latest"]
    meta = json.loads((tmp_path / "ckpt-2" / "metadata.json").read_text())
    assert {"rank-0.safetensors", "rank-1.safetensors"} <= set(meta["files"])
    assert Path(tmp_path / "ckpt-2" / "rank-1.json").read_text().count("3.weight") >= 1


@pytest.mark.timeout(150)
def test_unsplit_to_pipeline_stages_and_back(tmp_path):
    """One process saves a model; 2 pipeline stages restore it (each its own layers), train on
    with single-device parity and save; one process (and a plain module) restores the joined
    model."""
    import torch
    from ckpt_workers import global_batch, portable_model
    from pipe_ckpt_workers import pipeline_portable_worker

    from stratagem import Checkpoint, CheckpointManager
    from stratagem.train.checkpoint import load_state_dict

    K, M = 3, 2

    def train(model, steps):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for s in steps:
            x, y = global_batch(s)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    unsplit, split = tmp_path / "unsplit", tmp_path / "split"
    model = portable_model()
    train(model, range(K))
    writer = CheckpointManager(Checkpoint(model=model), unsplit)
    writer.save(K)
    writer.close()  # the directory's writer lock goes with it
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    stages = [r.value for r in run_workers(pipeline_portable_worker, 2, args=(str(unsplit), str(split), K, K + M))]
    assert [sorted(s["params"]) for s in stages] == [["0.bias", "0.weight"], ["2.bias", "2.weight"]]
    for s in stages:
        assert s["restored"].endswith(f"ckpt-{K}")
        for k, v in s["after_restore"].items():
            assert torch.equal(v, saved[k]), k  # each stage took its own layers, exactly
    joined = {**stages[0]["params"], **stages[1]["params"]}

    train(model, range(K, K + M))  # one device goes on from the same point, fresh Adam too
    for k, v in model.state_dict().items():
        torch.testing.assert_close(joined[k], v, rtol=1e-5, atol=1e-6, msg=k)

    # back to one process: the stages' files join into the whole model
    plain = portable_model()
    plain.load_state_dict(load_state_dict(split))
    restored = portable_model()
    reader = CheckpointManager(Checkpoint(model=restored), split)
    assert reader.restore_or_initialize().endswith(f"ckpt-{K + M}")
    reader.close()
    for k in joined:
        assert torch.equal(plain.state_dict()[k], joined[k]), k
        assert torch.equal(restored.state_dict()[k], joined[k]), k


@pytest.mark.timeout(120)
def test_pipeline_checkpoint_writes_a_tied_weight_once(tmp_path):
    """The embedding on stage 0 tied to the head on stage 1: the checkpoint holds the tensor once
    (stage 0's file, under both names); restore puts it into both ends and training continues
    exactly; a checkpoint lacking it, or holding two values for it, is refused naming the tie."""
    import torch
    from pipe_ckpt_workers import tied_checkpoint_worker, tied_model

    from stratagem.train.checkpoint import load_state_dict

    r0, r1 = (r.value for r in run_workers(tied_checkpoint_worker, 2, args=(str(tmp_path),)))
    assert r0["names"] == ["0.weight", "1.bias", "1.weight"] and r1["names"] == ["3.out.weight"]
    assert r0["same"] and r1["same"]
    assert torch.equal(r0["restored_end"], r1["restored_end"]) and torch.equal(r0["end"], r1["end"])  # tied
    ckpt = tmp_path / "ckpt-2"
    rank0 = json.loads((ckpt / "rank-0.json").read_text())["model"]["__dict__"]
    rank0 = {k: v["__tensor__"] for k, v in rank0}
    assert rank0["0.weight"] == rank0["3.out.weight"]  # one tensor, both names
    assert json.loads((ckpt / "rank-1.json").read_text())["model"] == {"__dict__": []}  # stage 1 writes none
    # the unsplit model reads it back as one tied parameter
    state = load_state_dict(ckpt)
    assert state["0.weight"] is state["3.out.weight"]
    plain = tied_model()
    plain.load_state_dict(state)
    assert plain[0].weight is plain[3].out.weight
    for r in (r0, r1):
        assert ("the checkpoint's 'model' lacks the weight tied across stages 0.weight = 3.out.weight "
                "(stages 0, 1), which the lowest stage holding it (stage 0) writes") in r["missing"], r["missing"]
        assert ("holds different values for 0.weight and 3.out.weight, which are one weight tied across "
                "stages") in r["different"], r["different"]
