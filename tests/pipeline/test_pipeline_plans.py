"""Pipeline plans as data: schedules, partitions, micro-batch scaling, configuration errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from stratagem.pipeline import (
    Action,
    PipelineConfig,
    PipelineConfigError,
    block_partition,
    gpipe,
    loss_scales,
    make_schedule,
    one_f_one_b,
    rematerialize_stop,
    simulate,
    split_sizes,
)
from stratagem.pipeline.materialize import flatten, materialize
from stratagem.pipeline.partition import Partition, check_balance
from stratagem.pipeline.schedule import Schedule, check
from stratagem.pipeline.stage import _rejects_its_input


def test_gpipe_table():
    assert str(gpipe(2, 4)) == (
        "stage 0: F0 F1 F2 F3 B3 B2 B1 B0\n"
        "stage 1: F0 F1 F2 F3 B3 B2 B1 B0"
    )
    assert gpipe(1, 2)[0] == (Action("F", 0), Action("F", 1), Action("B", 1), Action("B", 0))


def test_1f1b_table():
    assert str(one_f_one_b(3, 4)) == (
        "stage 0: F0 F1 F2 B0 F3 B1 B2 B3\n"
        "stage 1: F0 F1 B0 F2 B1 F3 B2 B3\n"
        "stage 2: F0 B0 F1 B1 F2 B2 F3 B3"
    )
    # fewer micro-batches than stages still runs every micro-batch once
    assert str(one_f_one_b(3, 1)) == "stage 0: F0 B0\nstage 1: F0 B0\nstage 2: F0 B0"


def test_simulated_clock_and_bubble():
    ticks = simulate(gpipe(2, 2))
    assert [" ".join(str(a) if a else "--" for a in t) for t in ticks] == [
        "F0 --", "F1 F0", "-- F1", "-- B1", "B1 B0", "B0 --",
    ]  # fmt: skip
    print(gpipe(2, 2).timeline())
    for k, m in itertools.product([1, 2, 3, 4], [1, 2, 3, 5, 8]):
        for plan in (gpipe(k, m), one_f_one_b(k, m)):
            check(plan)
            # forward and backward each take M + K - 1 ticks: the bubble of the GPipe paper
            assert len(simulate(plan)) == 2 * (m + k - 1), (plan.name, k, m)


def test_in_flight_micro_batches():
    def peak(acts):
        live = best = 0
        for a in acts:
            live += 1 if a.kind == "F" else -1
            best = max(best, live)
        return best

    assert [peak(a) for a in gpipe(4, 8).stages] == [8, 8, 8, 8]
    assert [peak(a) for a in one_f_one_b(4, 8).stages] == [4, 3, 2, 1]


def test_bad_plans_are_refused():
    bad = Schedule("x", 2, 1, ((Action("F", 0), Action("B", 0)), (Action("B", 0), Action("F", 0))))
    with pytest.raises(ValueError, match="B0 before F0"):
        check(bad)
    swapped = Schedule("x", 2, 2, (gpipe(1, 2)[0], one_f_one_b(1, 2)[0]))
    with pytest.raises(ValueError, match="different orders"):
        check(swapped)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        make_schedule("zigzag", 2, 2)
    assert make_schedule("1F1B", 2, 2) == one_f_one_b(2, 2)


def _brute(costs, k):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def test_block_partition():
    assert block_partition([1, 1, 1, 1], 2) == [2, 2]
    assert block_partition([4, 1, 1, 1, 1], 2) == [1, 4]
    assert block_partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]
    assert block_partition([0, 0, 0], 3) == [1, 1, 1]
    assert block_partition([5], 1) == [1]
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(2, 9, (1,), generator=g))
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        costs = torch.randint(0, 10, (n,), generator=g).tolist()
        counts = block_partition(costs, k)
        assert len(counts) == k and sum(counts) == n and min(counts) >= 1
        bounds = [0, *itertools.accumulate(counts)]
        assert max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) == _brute(costs, k)
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        block_partition([1, 1], 3)


def test_partition_report():
    p = Partition((2, 1), "params", ("0", "1", "2"), (3.0, 0.0, 5.0))
    assert list(p.layers(1)) == [2]
    assert p.stage_costs() == (3.0, 5.0)
    assert str(p) == (
        "partition by params: balance=[2, 1]\n"
        "  stage 0: layers 0..1 [0, 1]  cost 3\n"
        "  stage 1: layers 2..2 [2]  cost 5"
    )


def test_balance_must_cover_every_layer():
    assert check_balance([2, 3], 5, 2) == [2, 3]
    with pytest.raises(PipelineConfigError, match=r"covers 4 layers but the model has 5"):
        check_balance([2, 2], 5, 2)
    with pytest.raises(PipelineConfigError, match=r"has 3 entries but there are 2 stages"):
        check_balance([1, 1, 3], 5, 2)


def test_micro_batches_and_loss_scales():
    assert split_sizes(11, 4) == [3, 3, 3, 2]
    assert split_sizes(8, 8) == [1] * 8
    with pytest.raises(ValueError, match="a mini-batch of 3 examples cannot be split into 4"):
        split_sizes(3, 4)
    assert loss_scales([3, 2], "mean", 5) == [0.6, 0.4]
    assert loss_scales([3, 2], "mean", 10) == [0.3, 0.2]  # another copy holds the other 5
    assert loss_scales([3, 2], "sum", 10) == [1.0, 1.0]
    assert [rematerialize_stop(m, 4) for m in ("always", "except_last", "never")] == [4, 3, 0]


def test_config_validation_says_what_was_received():
    cases = [
        (dict(num_stages=0, num_microbatches=2), "num_stages must be an integer >= 1, got 0"),
        (dict(num_stages=2, num_microbatches=0), "num_microbatches must be an integer >= 1, got 0"),
        (dict(num_stages=2, num_microbatches=2, data_parallel=0), "data_parallel must be .* got 0"),
        (dict(num_stages=2, num_microbatches=2, schedule="zigzag"), "schedule must be one of .* 'zigzag'"),
        (dict(num_stages=2, num_microbatches=2, rematerialize="sometimes"), "rematerialize must be .*'sometimes'"),
        (dict(num_stages=2, num_microbatches=2, balance=[3]), r"balance=\[3\] must hold 2 positive"),
        (dict(num_stages=2, num_microbatches=2, balance=[2, 0]), r"balance=\[2, 0\]"),
        (dict(num_stages=2, num_microbatches=2, balance="flops"), "'flops'"),
    ]
    for kw, msg in cases:
        k, m = kw.pop("num_stages"), kw.pop("num_microbatches")
        with pytest.raises(PipelineConfigError, match=msg):
            PipelineConfig.build(k, m, **kw)
    cfg = PipelineConfig.build(2, 4, data_parallel=2)
    assert cfg.pipeline_groups() == [[0, 1], [2, 3]]
    assert cfg.replica_groups() == [[0, 2], [1, 3]]
    with pytest.raises(PipelineConfigError, match=r"has 3 processes .* needs 2 x 2 = 4"):
        cfg.check_world(3)


def test_strategy_validates_before_launching():
    from stratagem.distribute.strategies.pipeline import PipelineStrategy

    with pytest.raises(PipelineConfigError, match="num_microbatches must be an integer >= 1, got 0"):
        PipelineStrategy(2, 0, devices="cpu")


def _model():
    return nn.Sequential(
        nn.Linear(4, 6), nn.Sequential(nn.ReLU(), nn.Sequential(nn.Linear(6, 6))),
        nn.BatchNorm1d(6), nn.Linear(6, 2),
    )  # fmt: skip


@pytest.mark.parametrize("owned", [range(0, 2), range(2, 5)])
def test_meta_model_materializes_like_the_unsplit_model(owned):
    torch.manual_seed(3)
    ref = _model()
    after_ref = torch.rand(3)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    with torch.device("meta"):
        model = _model()
    layers = flatten(model)
    assert [n for n, _ in layers] == ["0", "1.0", "1.1.0", "2", "3"]
    materialize(layers, owned, torch.device("cpu"), state)
    assert torch.equal(torch.rand(3), after_ref)  # the RNG is where the unsplit build left it
    refs = dict(ref.state_dict())
    for j, (name, layer) in enumerate(layers):
        for k, t in layer.state_dict().items():
            if j in owned:
                assert torch.equal(t, refs[f"{name}.{k}"]), (name, k)
            else:
                assert t.device.type == "meta"


def test_flatten_needs_sequential():
    with pytest.raises(PipelineConfigError, match="needs an nn.Sequential .* got Linear"):
        flatten(nn.Linear(2, 2))


def test_zero_bubble_plan():
    from stratagem.pipeline import zero_bubble

    assert str(zero_bubble(2, 4)) == (
        "stage 0: F0 F1 I0 W0 I1 F2 W1 F3 I2 W2 I3 W3\n"
        "stage 1: F0 I0 F1 I1 W0 W1 F2 I2 F3 I3 W2 W3"
    )
    assert make_schedule("zero-bubble", 2, 4) == zero_bubble(2, 4)

    def peak(acts):  # micro-batches holding activations: forwarded, weight gradients not taken
        live = best = 0
        for a in acts:
            live += {"F": 1, "W": -1}.get(a.kind, 0)
            best = max(best, live)
        return best

    for k, m in itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4, 8, 16]):
        plan = zero_bubble(k, m)
        check(plan)
        ticks = len(simulate(plan))
        # 1F1B with B as 2 ticks (I + W) takes 3M + 3(K - 1); zero-bubble's W fill part of it
        assert 3 * m + max(0, 2 * k - 3) <= ticks <= 3 * m + max(0, 2 * k - 2), (k, m, ticks)
        if m >= k:
            peaks = [peak(a) for a in plan.stages]
            assert max(peaks) == k == peaks[0] and peaks == sorted(peaks, reverse=True), peaks


def test_split_plans_are_checked():
    f, i, w = (lambda j, kind=kind: Action(kind, j) for kind in "FIW")
    with pytest.raises(ValueError, match="W0 before I0"):
        check(Schedule("x", 1, 1, ((f(0), w(0), i(0)),)))
    with pytest.raises(ValueError, match="does not run each micro-batch once"):
        check(Schedule("x", 1, 1, ((f(0), i(0)),)))
    with pytest.raises(ValueError, match="mixes or misnames"):
        check(Schedule("x", 1, 1, ((f(0), Action("B", 0), w(0)),)))
    # W sends nothing: a stage may run it while its neighbour waits
    fine = Schedule("x", 2, 2, ((f(0), f(1), i(0), w(0), i(1), w(1)), (f(0), i(0), f(1), i(1), w(1), w(0))))
    check(fine)
    assert len(simulate(fine)) == 7


class _Scaled(nn.Module):
    """A raw parameter used by the parent around a child that holds its own, and the parent
    reading the child's weight directly besides calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.full((6,), 0.5))

    def forward(self, x):
        return self.inner(x * self.scale) + 0.1 * x @ self.inner.weight.t()


class _Borrow(nn.Module):
    """A layer that also uses another layer's weight (held by that layer alone)."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.other = [other]  # not registered: the weight's only holder is `other`

    def forward(self, x):
        return self.lin(x) + 0.1 * torch.tanh(x @ self.other[0].weight)


def _awkward_model():
    tied = nn.Linear(6, 6)
    twice = nn.Linear(6, 6)
    lender = nn.Linear(6, 6)
    return nn.Sequential(
        nn.Linear(4, 6), nn.ReLU(inplace=True), _Scaled(), tied, nn.Tanh(), tied, lender, nn.Sequential(_Borrow(lender)),
        nn.Sequential(twice, nn.ReLU(), twice), nn.BatchNorm1d(6), nn.Dropout(0.3), nn.Linear(6, 3),
    )  # fmt: skip


@pytest.mark.parametrize("remat", ["never", "always"])
def test_split_backward_matches_autograd(remat):
    """One stage running F/I/W (zero-bubble) leaves the gradients of a plain backward: in-place
    ReLU after a linear layer, a parent using a raw parameter and its child's weight, a layer
    using another layer's weight, a layer used twice, weights tied between two positions,
    BatchNorm, dropout replayed."""
    from stratagem.pipeline import zero_bubble
    from stratagem.pipeline.runtime import run_plan
    from stratagem.pipeline.stage import Stage

    torch.manual_seed(0)
    model = _awkward_model()
    ref = _awkward_model()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    loss_fn = nn.CrossEntropyLoss()
    sizes = split_sizes(10, 3)
    layers = list(model)
    stage = Stage(0, 1, layers, 0, [str(j) for j in range(len(layers))],
                  [type(m).__name__ for m in layers], torch.device("cpu"), loss_fn)  # fmt: skip
    scales = loss_scales(sizes, "mean", 10)
    torch.manual_seed(5)
    loss = run_plan(zero_bubble(1, 3)[0], stage, None, list(x.split(sizes)), list(y.split(sizes)), scales, sizes,
                    rematerialize_stop(remat, 3))  # fmt: skip
    torch.manual_seed(5)
    ref_loss = sum(loss_fn(ref(xs), ys) * sc for xs, ys, sc in zip(x.split(sizes), y.split(sizes), scales))
    ref_loss.backward()
    assert torch.allclose(loss.float(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, refs[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, dict(ref.named_buffers())[name], msg=name)


def test_weight_pass_is_separate():
    """After I the weights of parameter-holding layers have no gradient yet; W gives it."""
    from stratagem.pipeline.stage import Stage

    torch.manual_seed(0)
    layers = [nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)]
    stage = Stage(1, 2, layers, 0, ["0", "1", "2"], ["a", "b", "c"], torch.device("cpu"))
    stage.split_backward()
    x = torch.randn(3, 4)
    out = stage.forward(0, x, recompute=False)
    gin = stage.backward_input(0, torch.ones_like(out))
    assert gin is not None and gin.shape == x.shape
    assert all(p.grad is None for m in layers for p in m.parameters())
    assert stage.backward_weight(0)
    ref = nn.Sequential(*layers)
    grads = [p.grad.clone() for p in ref.parameters()]
    ref.zero_grad()
    xr = x.clone().requires_grad_(True)
    ref(xr).sum().backward()
    for g, p in zip(grads, ref.parameters()):
        assert torch.equal(g, p.grad)
    assert torch.equal(gin, xr.grad)


def test_split_backward_of_transformer_blocks():
    """nn.TransformerEncoderLayer: MultiheadAttention holds in_proj_weight itself and uses its
    out_proj's parameters without calling it; the split backward still gives autograd's result."""
    from stratagem.pipeline import zero_bubble
    from stratagem.pipeline.runtime import run_plan
    from stratagem.pipeline.stage import Stage

    def blocks():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True, norm_first=True),
            nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True), nn.Flatten(), nn.Linear(40, 3),
        )  # fmt: skip

    model, ref = blocks(), blocks()
    x, y = torch.randn(6, 5, 8), torch.randint(0, 3, (6,))
    loss_fn = nn.CrossEntropyLoss()
    sizes = split_sizes(6, 2)
    scales = loss_scales(sizes, "mean", 6)
    layers = list(model)
    stage = Stage(0, 1, layers, 0, [str(j) for j in range(4)], ["l"] * 4, torch.device("cpu"), loss_fn)
    torch.manual_seed(5)
    run_plan(zero_bubble(1, 2)[0], stage, None, list(x.split(sizes)), list(y.split(sizes)), scales, sizes, 1)
    torch.manual_seed(5)
    sum(loss_fn(ref(xs), ys) * sc for xs, ys, sc in zip(x.split(sizes), y.split(sizes), scales)).backward()
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, refs[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_interleaved_1f1b_plan():
    from stratagem.pipeline import interleaved_1f1b
    from stratagem.pipeline.schedule import B, F

    # worked by hand: rank 0 warms up with (v-1) x 2 + 2 (K-1-0) = 4 forwards, rank 1 with 2; the
    # forwards take a round of 2 micro-batches per chunk in turn, the backwards the chunks reversed
    plan = interleaved_1f1b(2, 2, 2)
    assert str(plan) == (
        "stage 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\n"
        "stage 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"
    )
    assert plan[1][:4] == (F(0, 1), F(1, 1), F(0, 3), B(0, 3))
    assert (plan.num_chunks, plan.chunks_of(1)) == (4, (1, 3))
    assert plan.timeline() == (
        "stage 0: 0F0 0F1 2F0 2F1     2B0     2B1 0B0 0B1\n"
        "stage 1:     1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"
    )
    assert str(interleaved_1f1b(2, 4, 2)) == (
        "stage 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
        "stage 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )
    assert make_schedule("Interleaved-1F1B", 2, 4, 2) == interleaved_1f1b(2, 4, 2)
    # every size torch accepts: each chunk runs every micro-batch once, neighbours agree on the
    # order of their messages, and the plan never deadlocks
    for k, m, v in itertools.product([2, 3, 4], range(1, 13), [1, 2, 3]):
        if m % max(1, m // k):
            continue
        plan = interleaved_1f1b(k, m, v)
        check(plan)
        assert sum(a is not None for t in simulate(plan) for a in t) == 2 * m * k * v
    # v = 1 is 1F1B with torch's warm-up (2 (K-1-r) forwards, not K-1-r)
    assert [a.kind for a in interleaved_1f1b(2, 4, 1)[0]] == list("FFFBFBBB")


def test_interleaved_zero_bubble_plan():
    from stratagem.pipeline import interleaved_zero_bubble

    # torch's ScheduleInterleavedZeroBubble order: warm-up (v-1) x 2 + (K-1-r), rank r holding r
    # W passes back; zero_bubble with virtual_stages > 1 is this plan
    plan = interleaved_zero_bubble(2, 4, 2)
    assert str(plan) == (
        "stage 0: 0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3\n"
        "stage 1: 1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3"
    )
    assert make_schedule("zero_bubble", 2, 4, 2) == plan
    assert make_schedule("zero_bubble", 2, 4).virtual_stages == 1  # ZB-H1 without virtual stages
    for k, m, v in itertools.product([2, 3, 4], range(1, 13), [2, 3]):
        if m % max(1, m // k) == 0:
            p = interleaved_zero_bubble(k, m, v)
            check(p)
            assert sum(a is not None for t in simulate(p) for a in t) == 3 * m * k * v


def test_interleaved_refuses_what_does_not_fit():
    from stratagem.pipeline import interleaved_1f1b

    with pytest.raises(ValueError, match=r"num_microbatches=5 is not a multiple of 2 \(num_stages=2\); use"):
        interleaved_1f1b(2, 5, 2)
    cases = [
        (dict(num_stages=2, num_microbatches=5, schedule="interleaved_1f1b"), "not a multiple of 2"),
        (dict(num_stages=1, num_microbatches=4, schedule="interleaved_1f1b"), "needs num_stages >= 2, got num_stages=1"),
        (dict(num_stages=2, num_microbatches=4, schedule="1f1b", virtual_stages=2), "virtual_stages=2 needs an interleaved"),
        (dict(num_stages=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=0), "virtual_stages must be .* got 0"),
        (dict(num_stages=2, num_microbatches=4, schedule="interleaved_1f1b", balance=[2, 2]),
         r"balance=\[2, 2\] must hold 4 positive layer counts \(one per chunk, num_stages=2 x virtual_stages=2\)"),
    ]  # fmt: skip
    for kw, msg in cases:
        k, m = kw.pop("num_stages"), kw.pop("num_microbatches")
        with pytest.raises(PipelineConfigError, match=msg):
            PipelineConfig.build(k, m, **kw)
    cfg = PipelineConfig.build(2, 4, schedule="interleaved_1f1b", virtual_stages=3)
    assert (cfg.num_chunks, cfg.chunks_of(1), cfg.make_schedule().virtual_stages) == (6, (1, 3, 5), 3)
    assert PipelineConfig.build(2, 4, schedule="interleaved_1f1b").virtual_stages == 2
    # a chunk placed on the wrong rank is refused
    from stratagem.pipeline.schedule import B, F

    with pytest.raises(ValueError, match="runs 1F0 on chunk 1, which it does not hold"):
        check(Schedule("x", 2, 1, ((F(0, 1), B(0, 1)), (F(0, 0), B(0, 0))), 1))


@pytest.mark.parametrize("first", [False, True])
def test_attention_weights_wait_for_the_weight_pass(first):
    """nn.MultiheadAttention's in_proj_weight (held by the parent of out_proj) and out_proj's
    weight (used without calling out_proj) get their gradients in W too, from the autograd nodes
    the I pass went through; a tied weight and a first stage (no input gradient) as well."""
    from stratagem.pipeline.stage import Stage

    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
    tied = nn.Linear(8, 8)
    layers = [block, tied, nn.Tanh(), tied]  # the Linear called twice: its weight is reached twice
    stage = Stage(0 if first else 1, 2, layers, 0, ["0", "1", "2", "3"], ["l"] * 4, torch.device("cpu"))
    stage.split_backward()
    x = torch.randn(3, 5, 8)
    out = stage.forward(0, x, recompute=False)
    g = torch.randn_like(out)
    gin = stage.backward_input(0, g)
    params = list(stage.module.parameters())
    assert all(p.grad is None for p in params)
    assert stage.backward_weight(0)
    grads = [p.grad.clone() for p in params]
    stage.module.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_(not first)
    h = xr
    for layer in layers:
        h = layer(h)
    h.backward(g)
    for p, got in zip(params, grads):
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6)
    if first:
        assert gin is None
    else:
        torch.testing.assert_close(gin, xr.grad)


# --- which first-layer errors are the stage boundary's (StageShapeError) -------------------------
@pytest.mark.parametrize("layer,x", [
    (nn.Linear(8, 3), torch.randn(4, 7)),  # mat1 and mat2 shapes cannot be multiplied
    (nn.Conv2d(3, 4, 3), torch.randn(2, 5, 8, 8)),  # expected input[...] to have 3 channels
    (nn.Conv2d(3, 4, 3), torch.randn(8)),  # expected 3D or 4D input
    (nn.LayerNorm(8), torch.randn(4, 16)),  # expected input with shape [*, 8]
    (nn.Embedding(10, 3), torch.randn(4)),  # indices of a float dtype
])
def test_a_first_layer_that_rejects_its_input_is_a_shape_error(layer, x):
    with pytest.raises(Exception) as info:
        layer(x)
    assert _rejects_its_input(info.value)


@pytest.mark.parametrize("error", [ValueError("boom in forward"), KeyError("x"), ZeroDivisionError("division by zero")])
def test_a_first_layer_that_fails_on_its_own_is_not_a_shape_error(error):
    # (reported as that layer's failure, with the input's shape, not as the boundary's)
    assert not _rejects_its_input(error)
