"""strategy.profile(): every stage's actions gathered, a Chrome trace and a PNG written by rank 0,
the measured bubble next to the bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from stratagem.distribute.strategies.pipeline import PipelineStrategy
from stratagem.pipeline.timeline import Event, Timeline
from stratagem.testing import run_workers


def profile_worker(directory: str) -> dict:
    out: dict = {}
    for schedule in ("gpipe", "zero_bubble"):
        s = PipelineStrategy(2, 4, schedule=schedule, devices="cpu")
        with s.scope():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
            pipe = s.pipeline(model, nn.CrossEntropyLoss(), verbose=False)
        x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
        s.run(pipe.train_step, args=(x, y))  # not recorded
        with s.profile(str(Path(directory) / schedule)) as timeline:
            for _ in range(2):
                s.run(pipe.train_step, args=(x, y))
        s.run(pipe.train_step, args=(x, y))  # not recorded either
        out[schedule] = {
            "stages": [[(e.step, e.kind, e.microbatch) for e in st] for st in timeline.stages],
            "ordered": all(e.start <= e.end and 0 <= e.wait <= e.end - e.start for st in timeline.stages for e in st),
            "bubble": timeline.bubble, "bound": timeline.bound, "summary": timeline.summary(),
            "paths": (str(timeline.trace_path), str(timeline.png_path)),
            "plan": [[(a.kind, a.microbatch) for a in acts] for acts in s.schedule.stages],
        }  # fmt: skip
    return out


@pytest.mark.timeout(120)
def test_profile_writes_trace_and_picture(tmp_path):
    r0, r1 = (r.value for r in run_workers(profile_worker, 2, args=(str(tmp_path),), timeout=100))
    for schedule in ("gpipe", "zero_bubble"):
        a, b = r0[schedule], r1[schedule]
        assert a["stages"] == b["stages"] and a["bubble"] == b["bubble"]  # every stage has all
        assert a["ordered"]
        # per stage: the plan's actions, once per profiled step, in plan order
        for s, events in enumerate(a["stages"]):
            assert events == [(step, k, i) for step in (0, 1) for k, i in a["plan"][s]]
        assert a["bound"] == pytest.approx(1 / 5)
        assert 0.0 < a["bubble"] < 1.0
        assert "(K-1)/(M+K-1) = 20.0%" in a["summary"]
        trace_path, png_path = (Path(p) for p in a["paths"])
        assert trace_path == tmp_path / f"{schedule}.json" and png_path == tmp_path / f"{schedule}.png"
        assert b["paths"] == ("None", "None")  # only rank 0 writes
        trace = json.loads(trace_path.read_text())
        actions = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "wait"]
        kinds = {"gpipe": {"F", "B"}, "zero_bubble": {"F", "I", "W"}}[schedule]
        for s in (0, 1):
            mine = [e for e in actions if e["tid"] == s]
            assert {e["cat"] for e in mine} == kinds
            assert sorted((e["args"]["step"], e["name"]) for e in mine) == sorted(
                (step, f"{k}{i}") for step, k, i in a["stages"][s]
            )
            assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
        names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        assert names == {"stage 0", "stage 1"}
        assert trace["otherData"]["bubble"] == pytest.approx(a["bubble"])
        png = png_path.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
        from matplotlib.image import imread

        pixels = imread(png_path)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 500
        assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::97].tolist()}) > 5  # not blank


def test_bubble_arithmetic():
    """Two stages, one step: stage 0 busy 0-1 and 3-4, stage 1 busy 1-3 (wait 0.5 inside its F)."""
    t = Timeline("gpipe", 2, 1, [
        [Event(0, "F", 0, 0.0, 1.0), Event(0, "B", 0, 3.0, 4.0)],
        [Event(0, "F", 0, 0.5, 2.0, wait=0.5), Event(0, "B", 0, 2.0, 3.0)],
    ])  # fmt: skip
    assert t.bubble == pytest.approx(1 - 4.0 / 8.0)
    assert t.bound == pytest.approx(0.5)
    with pytest.raises(ValueError, match="step 3 was not profiled"):
        t.step_bubble(3)


def test_chunks_in_the_trace():
    """Interleaved plans' events carry their chunk: named as the plan prints them (``2F0``)."""
    t = Timeline("interleaved_1f1b", 2, 1, [
        [Event(0, "F", 0, 0.0, 1.0, chunk=0), Event(0, "F", 0, 2.0, 3.0, chunk=2)],
        [Event(0, "F", 0, 1.0, 2.0, chunk=1), Event(0, "F", 0, 3.0, 4.0, chunk=3)],
    ])  # fmt: skip
    actions = [e for e in t.chrome_trace()["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["name"], e["args"]["chunk"]) for e in actions] == [
        (0, "0F0", 0), (0, "2F0", 2), (1, "1F0", 1), (1, "3F0", 3),
    ]  # fmt: skip
    assert Event(0, "B", 3, 0.0, 1.0).label == "B3"
