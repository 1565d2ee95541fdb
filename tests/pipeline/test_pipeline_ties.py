"""A weight tied across 3 stages' first and last (the middle stage holds no end and adds zeros to
the sum), under 1F1B and zero-bubble: equal to the unsplit model, the two ends bit-identical."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stratagem.distribute.strategies.pipeline import PipelineStrategy
from stratagem.testing import run_workers


class Head(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = emb.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(h).transpose(1, 2)


def build() -> nn.Sequential:
    emb = nn.Embedding(11, 6)
    return nn.Sequential(emb, nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), Head(emb))


def three_stages(schedule: str) -> dict:
    s = PipelineStrategy(3, 2, balance=[1, 3, 1], schedule=schedule, devices="cpu")
    torch.manual_seed(0)
    pipe = s.pipeline(build(), nn.CrossEntropyLoss(), verbose=False)
    with s.scope():
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    torch.manual_seed(0)
    ref = build()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randint(0, 11, (6, 5), generator=g), torch.randint(0, 11, (6, 5), generator=g)
        s.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    refs = ref.state_dict()
    got = pipe.state_dict()
    return {
        "diff": max(float((v - refs[k]).abs().max()) for k, v in got.items()),
        "end": got.get("0.weight", got.get("4.out.weight")),
        "names": sorted(got),
    }


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_tie_between_first_and_last_of_three_stages(schedule: str) -> None:
    first, middle, last = (r.value for r in run_workers(three_stages, 3, args=(schedule,), timeout=80))
    assert first["names"] == ["0.weight"] and last["names"] == ["4.out.weight"] and middle["end"] is None
    for r in (first, middle, last):
        assert r["diff"] < 1e-5, r["diff"]
    assert torch.equal(first["end"], last["end"])
