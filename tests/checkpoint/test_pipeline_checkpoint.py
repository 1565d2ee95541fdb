"""Checkpoints under PipelineStrategy: every stage saves its own layers; resume is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipe_ckpt_workers import pipeline_checkpoint_worker

from stratagem.testing import run_workers


@pytest.mark.timeout(120)
def test_pipeline_stages_checkpoint_and_resume_exactly(tmp_path):
    r0, r1 = (r.value for r in run_workers(pipeline_checkpoint_worker, 2, args=(str(tmp_path),)))
    assert r0["names"] == ["0.bias", "0.weight"] and r1["names"] == ["3.bias", "3.weight"]
    assert r0["same"] and r1["same"] and r0["latest"]
    meta = json.loads((tmp_path / "ckpt-2" / "metadata.json").read_text())
    assert {"rank-0.safetensors", "rank-1.safetensors"} <= set(meta["files"])
    assert Path(tmp_path / "ckpt-2" / "rank-1.json").read_text().count("3.weight") >= 1
