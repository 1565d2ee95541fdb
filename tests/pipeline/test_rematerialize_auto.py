"""rematerialize="auto" (the default): activations kept where they fit the memory budget, the
fewest micro-batches recomputed where they do not; the same gradients either way."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.pipeline import gpipe, one_f_one_b, zero_bubble
from stratagem.pipeline import rematerialize as remat
from stratagem.pipeline.rematerialize import AutoRematerialize, peak_kept


def test_peak_kept_counts_what_each_schedule_holds_at_once():
    one = [1.0] * 4
    plan = gpipe(2, 4)[0]  # F0 F1 F2 F3 B3 B2 B1 B0 on stage 0
    assert peak_kept(plan, 0, one, 1) == 4  # never: all four forwards kept before the first backward
    assert peak_kept(plan, 3, one, 1) == 1  # except_last: the last kept, then one recomputed at a time
    assert peak_kept(plan, 4, one, 1) == 1  # always
    # 1F1B holds at most (stages - stage) micro-batches on each stage
    assert peak_kept(one_f_one_b(4, 8)[0], 0, [1.0] * 8, 1) == 4
    assert peak_kept(one_f_one_b(4, 8)[3], 0, [1.0] * 8, 1) == 1
    # a split backward keeps a micro-batch until its weight pass
    zb = zero_bubble(2, 4)[0]
    assert peak_kept(zb, 0, one, 1) >= peak_kept(one_f_one_b(2, 4)[0], 0, one, 1)
    # per-micro-batch sizes weigh in; chunks share a rank's measured bytes
    assert peak_kept(plan, 0, [2.0, 1.0, 1.0, 1.0], 1) == 5
    assert peak_kept(plan, 0, one, 2) == 2


def _auto(budget_bytes: int | None) -> AutoRematerialize:
    return AutoRematerialize(nn.Linear(2, 2), torch.device("cpu"), stage=0, budget=lambda device: budget_bytes)


def _measured(auto: AutoRematerialize, per_example: float, sizes: list[int]) -> None:
    x = torch.randn(sum(sizes), int(per_example // 4), requires_grad=False)
    w = torch.randn(x.shape[1], 1, requires_grad=True)
    with auto.measuring(sizes):
        (x * 1.0).sigmoid().mm(w).sum()  # sigmoid saves its output: per_example bytes per row


@pytest.mark.parametrize(
    ("budget_share_of_all", "expected_stop"),
    [(10.0, 0), (4.0, 0), (3.0, 1), (1.0, 3), (0.5, 4)],
)
def test_the_stop_is_the_fewest_recomputations_that_fit(budget_share_of_all, expected_stop):
    sizes = [8, 8, 8, 8]
    plan = gpipe(1, 4)[0]
    auto = _auto(None)
    assert auto.stop(plan, sizes, 1) == 3  # the first step: except_last, while measuring
    _measured(auto, 64, sizes)
    assert auto.bytes_per_example == pytest.approx(64, rel=0.01)
    all_kept = peak_kept(plan, 0, [64.0 * n for n in sizes], 1)
    auto.budget_bytes = budget_share_of_all * all_kept / 4  # as if measured with this much free
    assert auto.stop(plan, sizes, 1) == expected_stop


def test_memory_that_cannot_be_read_keeps_except_last(caplog):
    auto = _auto(None)
    with caplog.at_level(logging.INFO, logger="stratagem.pipeline"):
        _measured(auto, 64, [4, 4])
    assert auto.stop(gpipe(1, 2)[0], [4, 4], 1) == 1
    assert "cannot read the memory" in caplog.text


def _forwards(strategy: sg.Strategy, steps: int) -> list[int]:
    """Forward passes of the first layer in each of ``steps`` steps of a 1-stage, 4-micro-batch pipeline."""
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 4))
        pipe = strategy.pipeline(model, nn.CrossEntropyLoss())
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    calls = [0]
    pipe.module[0][0].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    g = torch.Generator().manual_seed(1)
    counts = []
    for _ in range(steps):
        x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
        calls[0] = 0
        strategy.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()
        counts.append(calls[0])
    return counts


def test_auto_keeps_activations_after_the_first_step_when_they_fit(caplog):
    with caplog.at_level(logging.INFO, logger="stratagem.pipeline"):
        counts = _forwards(sg.PipelineStrategy(1, 4, devices="cpu"), 3)
    assert counts == [4 + 3, 4, 4]  # except_last while measuring, then nothing recomputed
    assert "rematerialize='auto' keeps micro-batches 0..3 of 4" in caplog.text


def test_auto_recomputes_when_activations_do_not_fit(monkeypatch):
    monkeypatch.setattr(remat, "AUTO_BUDGET_SHARE", 1e-12)  # no room for even one micro-batch
    assert _forwards(sg.PipelineStrategy(1, 4, devices="cpu"), 3) == [4 + 3, 4 + 4, 4 + 4]


@pytest.mark.parametrize("mode", ["auto", "never", "except_last", "always"])
def test_every_mode_trains_the_same_model(mode):
    """Dropout replayed, so recomputing changes time and memory, never the parameters."""

    def train(m: str) -> list[torch.Tensor]:
        strategy = sg.PipelineStrategy(1, 4, rematerialize=m, devices="cpu")
        with strategy.scope():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 4))
            pipe = strategy.pipeline(model, nn.CrossEntropyLoss())
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(7)
        for _ in range(3):
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
            strategy.run(pipe.train_step, args=(x, y))
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in pipe.parameters()]

    for got, want in zip(train(mode), train("never")):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
