"""MirroredStrategy on 2-4 gloo processes: parity with one process, reductions, input, errors."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.testing import assert_matches_single_device, run_workers


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def make_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def per_example(logits, y):
    return nn.functional.cross_entropy(logits, y, reduction="none")


def global_batches(sizes):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def parity_worker(n: int) -> str:
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=n)
    # 3 steps: two full global batches of 8, then a partial batch of 3 (on 4 replicas one is empty)
    assert_matches_single_device(strategy, make_model, make_sgd, per_example, global_batches([8, 8, 3]))
    return "ok"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 4])
def test_parity_with_single_device(n):
    assert [r.value for r in run_workers(parity_worker, n, args=(n,))] == ["ok"] * n


# --- reductions, gathers and distributed input as tables of cases, on 2 replicas -------------

REDUCE_CASES = [
    # (op, axis, per-replica values for replicas 0/1, expected)
    ("sum", None, [[0.0, 1, 2, 3], [4.0, 5, 6, 7]], [4.0, 6, 8, 10]),
    ("sum", 0, [[0.0, 1, 2, 3], [4.0, 5, 6, 7]], 28.0),
    ("mean", None, [[0.0, 1, 2, 3], [4.0, 5, 6, 7]], [2.0, 3, 4, 5]),
    ("mean", 0, [[0.0, 1, 2, 3], [4.0, 5, 6, 7]], 3.5),
    # a last batch of 6 split 4/2: MEAN divides by the 6 examples, not by the 2 replicas
    ("mean", 0, [[1.0, 1, 1, 1], [4.0, 4]], 2.0),
    ("sum", 0, [[1.0, 1, 1, 1], [4.0, 4]], 12.0),
    # a replica with an empty batch counts for nothing
    ("mean", 0, [[3.0, 5.0], []], 4.0),
]

GATHER_CASES = [
    ([[0.0, 1], [2.0, 3, 4]], 0, [0.0, 1, 2, 3, 4]),
    ([[0.0, 1], []], 0, [0.0, 1]),
]

# (global batch sizes, per-replica sizes on 2 replicas) - tf.distribute's rebatching
DATASET_CASES = [
    ([4, 2], [[2, 2], [1, 1]]),  # range(6).batch(4) -> [0,1]/[2,3], then [4]/[5]
    ([3], [[2, 1]]),
    ([1], [[1, 0]]),  # one replica gets a zero-size batch
]


def semantics_worker() -> dict:
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    rank = strategy.extended.replica_id
    out: dict = {"reduce": [], "gather": [], "dataset": [], "nested": None}
    for op, axis, values, _ in REDUCE_CASES:
        got = strategy.reduce(op, torch.tensor(values[rank]), axis=axis)
        out["reduce"].append(got.tolist())
    for values, axis, _ in GATHER_CASES:
        out["gather"].append(strategy.gather(torch.tensor(values[rank]), axis=axis).tolist())
    nested = {"a": torch.tensor([1.0, 2.0]) * (rank + 1), "b": (torch.tensor(3), [torch.ones(2, 2)])}
    red = strategy.reduce("sum", nested)
    out["nested"] = [red["a"].tolist(), int(red["b"][0]), red["b"][1][0].tolist()]
    for sizes, _ in DATASET_CASES:
        total = sum(sizes)
        batches = [torch.arange(total)[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]
        out["dataset"].append([b.tolist() for b in strategy.experimental_distribute_dataset(batches)])
    # replica context inside run; cross-replica context outside
    ctx_in = strategy.run(lambda: (sg.get_replica_context().replica_id_in_sync_group,
                                   sg.get_replica_context().num_replicas_in_sync))
    with strategy.scope():
        out["cross_replica_ctx_is_none"] = sg.get_replica_context() is None
    out["ctx"] = list(ctx_in)
    out["all_reduce"] = strategy.run(lambda: sg.get_replica_context().all_reduce("sum", torch.tensor(rank + 1))).item()
    out["local_results"] = len(strategy.experimental_local_results(torch.tensor(1)))
    # per-replica pipelines of different lengths: replica 1 runs dry first and gets empty batches
    def dataset_fn(ctx: sg.InputContext):
        n = 3 if ctx.input_pipeline_id == 0 else 1
        return [(torch.full((2, 3), float(i)), torch.zeros(2, dtype=torch.int64)) for i in range(n)]

    shapes = [tuple(x.shape) for x, _ in strategy.distribute_datasets_from_function(dataset_fn)]
    out["from_function"] = shapes
    return out


@pytest.mark.timeout(180)
def test_reduce_gather_and_input_semantics():
    results = run_workers(semantics_worker, 2)
    for rank, res in enumerate(r.value for r in results):
        for (op, axis, _, want), got in zip(REDUCE_CASES, res["reduce"]):
            assert got == pytest.approx(want), (op, axis)
        for (_, _, want), got in zip(GATHER_CASES, res["gather"]):
            assert got == want
        assert res["nested"] == [[3.0, 6.0], 6, [[2.0, 2.0], [2.0, 2.0]]]
        for (_sizes, per_replica), got in zip(DATASET_CASES, res["dataset"]):
            assert [len(b) for b in got] == [s[rank] for s in per_replica]
        assert res["ctx"] == [rank, 2]
        assert res["cross_replica_ctx_is_none"]
        assert res["all_reduce"] == 3
        # every value but a reduce/gather result is taken as per-replica: one part per local
        # replica (tf gives 1 for a plain constant; see Strategy.experimental_local_results)
        assert res["local_results"] == 2
        assert res["from_function"] == ([(2, 3)] * 3 if rank == 0 else [(2, 3), (0, 3), (0, 3)])
    # the slices of range(6).batch(4): replica 0 gets [0,1] then [4]; replica 1 [2,3] then [5]
    assert results[0].value["dataset"][0] == [[0, 1], [4]]
    assert results[1].value["dataset"][0] == [[2, 3], [5]]


# --- eager and compiled steps agree; DDP-style mean reduction is an explicit opt-in -------------


def compiled_worker() -> str:
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    batches = global_batches([8, 8, 5])
    eager = assert_matches_single_device(strategy, make_model, make_sgd, per_example, batches)
    compiled = assert_matches_single_device(
        strategy, make_model, make_sgd, per_example, batches,
        wrap_step=lambda f: sg.function(f, jit_compile=True, backend="aot_eager"), atol=1e-5,
    )
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    return "ok"


def mean_reduction_worker() -> list[float]:
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2, gradient_reduction=sg.ReduceOp.MEAN)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(3, 1, bias=False)
    x = torch.ones(2, 3) * (strategy.extended.replica_id + 1)

    def step(x):
        model(x).mean().backward()  # a per-replica mean loss, DDP style
        return model.weight.grad.clone()

    return strategy.run(step, args=(x,)).flatten().tolist()


# test_compiled_step.py checks compiled against eager under Mirrored in the main tier; this one is
# in the slow tier (CI runs it): the main tier under 15 minutes
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_eager_and_compiled_steps_agree():
    assert [r.value for r in run_workers(compiled_worker, 2, timeout=220)] == ["ok", "ok"]


@pytest.mark.timeout(120)
def test_mean_gradient_reduction_opt_in():
    # replica inputs are all-ones and all-twos: DDP-style averaging gives 1.5 per weight
    for r in run_workers(mean_reduction_worker, 2):
        assert r.value == pytest.approx([1.5, 1.5, 1.5])


# --- bad input: a clear error on every replica, and no hang -------------------------------------


def errors_worker() -> dict:
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    rank = strategy.extended.replica_id
    out = {}
    outside = nn.Linear(2, 2)
    try:
        strategy.run(lambda x: outside(x), args=(torch.ones(1, 2),))
    except sg.OutsideScopeError as e:
        out["outside"] = str(e)
    with strategy.scope():
        inside = nn.Linear(2, 2)
    opt = torch.optim.SGD(outside.parameters(), lr=0.1)

    def step_with_foreign_optimizer(x):
        inside(x).sum().backward()
        opt.step()

    try:
        strategy.run(step_with_foreign_optimizer, args=(torch.ones(1, 2),))
    except sg.OutsideScopeError as e:
        out["optimizer"] = str(e)
    value = torch.zeros(3 if rank == 0 else 4)
    try:
        strategy.run(lambda: sg.get_replica_context().all_reduce("sum", value))
    except sg.ReplicaMismatchError as e:
        out["shape"] = str(e)
    structure = (torch.zeros(2), torch.zeros(2)) if rank == 0 else [torch.zeros(2)]
    try:
        strategy.run(lambda: sg.get_replica_context().all_reduce("sum", structure))
    except sg.ReplicaMismatchError as e:
        out["structure"] = str(e)
    # replicas that disagree on rank (a scalar here, a vector there) for reduce along an axis
    try:
        strategy.reduce("sum", torch.tensor(1.0) if rank == 0 else torch.ones(2), axis=0)
    except sg.ReplicaMismatchError as e:
        out["reduce_axis"] = str(e)
    # a replica that creates nothing in the scope while the other creates a layer
    try:
        with strategy.scope():
            if rank == 0:
                nn.Linear(2, 3)
    except ValueError as e:
        out["scope"] = str(e)
    # a replica whose per-replica pipeline yields nothing at all (namedtuple batches)
    def dataset_fn(ctx: sg.InputContext):
        return [Pair(torch.ones(2, 3), torch.zeros(2))] if ctx.input_pipeline_id == 0 else []

    out["empty_pipeline"] = [tuple(b.x.shape) for b in strategy.distribute_datasets_from_function(dataset_fn)]
    # still in sync afterwards: a correct collective works
    out["after"] = strategy.reduce("sum", torch.tensor(1.0)).item()
    return out


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@pytest.mark.timeout(120)
def test_bad_input_errors_on_every_replica():
    for r in run_workers(errors_worker, 2):
        res = r.value
        assert "created outside MirroredStrategy.scope()" in res["outside"]
        assert "SGD steps a parameter" in res["optimizer"]
        assert "replica 0: float32[3]; replica 1: float32[4]" in res["shape"]
        assert "replica 0: (float32[2], float32[2]); replica 1: [float32[2]]" in res["structure"]
        assert "reduce was called with different structures" in res["reduce_axis"]
        assert "replicas created different parameters" in res["scope"]
        assert res["empty_pipeline"] == ([(2, 3)] if r.rank == 0 else [(0, 3)])
        assert res["after"] == 2.0


# --- stratagem.data pipelines: rebatched and auto-sharded per replica ---------------------------


def data_pipeline_worker(tmp: str) -> dict:
    from pathlib import Path

    from stratagem import data

    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    out = {}
    shuffled = data.Dataset.range(10).shuffle(10, seed=1).batch(4)
    out["global"] = [b.tolist() for b in shuffled]
    out["shuffled"] = [b.tolist() for b in strategy.experimental_distribute_dataset(shuffled)]
    dropped = data.Dataset.range(11).batch(4, drop_remainder=True)
    out["dropped"] = [b.tolist() for b in strategy.experimental_distribute_dataset(dropped)]
    # FILE policy: 3 files on 2 replicas; replica 1 runs dry first and gets zero-size batches
    if strategy.extended.replica_id == 0:
        for i, n in enumerate([4, 2, 4]):
            Path(tmp, f"part{i}.txt").write_text("".join(f"{i}{j}\n" for j in range(n)))
    strategy.barrier()
    opts = data.Options()
    opts.distribute.auto_shard_policy = data.AutoShardPolicy.FILE
    lines = (
        data.TextLineDataset(sorted(str(p) for p in Path(tmp).glob("part*.txt")))
        .map(lambda s: int(s))
        .batch(4)
        .with_options(opts)
    )
    out["files"] = [b.tolist() for b in strategy.experimental_distribute_dataset(lines)]
    return out


@pytest.mark.timeout(120)
def test_stratagem_datasets_are_rebatched_and_sharded(tmp_path):
    r0, r1 = (r.value for r in run_workers(data_pipeline_worker, 2, args=(str(tmp_path),)))
    # the union of the replicas' k-th batches is exactly the k-th global batch
    assert [sorted(a + b) for a, b in zip(r0["shuffled"], r1["shuffled"])] == [sorted(g) for g in r0["global"]]
    assert [len(b) for b in r0["shuffled"]] == [2, 2, 1] and [len(b) for b in r1["shuffled"]] == [2, 2, 1]
    # drop_remainder: the partial third global batch is dropped on both replicas
    assert r0["dropped"] == [[0, 1], [4, 5]] and r1["dropped"] == [[2, 3], [6, 7]]  # tf: contiguous runs
    # files 0 and 2 go to replica 0, file 1 to replica 1, which then gets zero-size batches
    assert r0["files"] == [[0, 1], [2, 3], [20, 21], [22, 23]]
    assert r1["files"] == [[10, 11], [], [], []]


# --- gradient accumulation over several backward passes is exact -------------------------------


def accumulation_worker() -> list[list[float]]:
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    rank = strategy.extended.replica_id
    torch.manual_seed(0)
    with strategy.scope():
        model = make_model()
        opt = make_sgd(model.parameters())
    batches = global_batches([8, 8, 8, 8])  # two optimizer steps of two accumulated halves

    def accumulate(x, y):
        loss = sg.compute_average_loss(per_example(model(x), y), global_batch_size=16)
        loss.backward()  # no zero_grad in between: gradients accumulate

    for step in range(2):
        opt.zero_grad()
        for x, y in batches[2 * step : 2 * step + 2]:
            strategy.run(accumulate, args=(x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]))
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_gradient_accumulation_matches_single_device():
    torch.manual_seed(0)
    model = make_model()
    opt = make_sgd(model.parameters())
    batches = global_batches([8, 8, 8, 8])
    for step in range(2):
        opt.zero_grad()
        for x, y in batches[2 * step : 2 * step + 2]:
            (per_example(model(x), y).sum() / 16).backward()
        opt.step()
    want = [p.detach().flatten().tolist() for p in model.parameters()]
    for r in run_workers(accumulation_worker, 2):
        for got, exp in zip(r.value, want):
            assert got == pytest.approx(exp, rel=1e-5, abs=1e-6)


# --- every collective has a finite timeout: a replica that is alive but never joins --------------


def stuck_peer_worker() -> str:
    import time

    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2, timeout=4)
    if strategy.extended.replica_id == 1:
        time.sleep(10)  # alive (heartbeats go on) but never joins the collective
        return "slept"
    start = time.monotonic()
    try:
        strategy.reduce("sum", torch.ones(3))
    except sg.CollectiveError as e:
        return f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}"
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_stuck_replica_becomes_a_timeout_error_not_a_hang():
    r0, r1 = run_workers(stuck_peer_worker, 2, timeout=90)
    assert r0.value.startswith("CollectiveTimeoutError"), r0.value
    assert "timed out" in r0.value and float(r0.value.split(" after ")[1].split("s")[0]) < 15
    assert r1.value == "slept"


# --- garbage collected at different moments on different replicas -----------------------------


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.full((8,), 0.5))

    def forward(self, x):
        return x * self.factor


def make_buffered_model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), _Scale(), nn.Tanh(), nn.Linear(8, 3))


def _dropped_in_a_cycle(strategy) -> None:
    """A model made in the scope, then dropped while caught in a reference cycle: Python frees it
    only when its collector runs, which is not at the same moment on every replica."""
    with strategy.scope():
        model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    model.cycle = [model]  # type: ignore[assignment]


def collected_unevenly_worker() -> str:
    import copy
    import gc

    gc.disable()  # the collector runs only where this test says
    try:
        strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
        first_replica = strategy.extended.replica_id == 0
        # 1. dropped before the next model's scope closes, freed on replica 0 only: the
        #    replicas agree on which parameters to reduce and which buffers to broadcast
        _dropped_in_a_cycle(strategy)
        if first_replica:
            gc.collect()
        assert_matches_single_device(strategy, make_buffered_model, make_sgd, per_example, global_batches([8, 8, 3]))
        # 2. dropped after the scopes closed, freed on replica 0 only between steps: the buckets
        #    reduced and the buffers broadcast at the next step stay the same on both
        with strategy.scope():
            torch.manual_seed(0)
            kept = make_buffered_model()
            opt = make_sgd(kept.parameters())
        _dropped_in_a_cycle(strategy)
        if first_replica:
            gc.collect()
        ref = copy.deepcopy(kept)
        ref_opt = make_sgd(ref.parameters())
        x, y = global_batches([8])[0]
        per_example(ref(x), y).mean().backward()
        ref_opt.step()
        batches = iter(strategy.experimental_distribute_dataset([(x, y)]))

        def step(xb, yb):
            opt.zero_grad()
            (per_example(kept(xb), yb).sum() / 8).backward()
            opt.step()

        strategy.run(step, args=next(batches))
        for (name, a), b in zip(kept.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(a, b, msg=name)
        return "ok"
    finally:
        gc.enable()


@pytest.mark.timeout(120)
def test_models_garbage_collected_at_different_moments_on_each_replica():
    assert [r.value for r in run_workers(collected_unevenly_worker, 2)] == ["ok"] * 2


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def accumulate_across_a_scope_worker() -> list[float]:
    """Gradients accumulated over two strategy.run calls with a scope in between (a model made
    there rebuilds the reducer): the first call's already reduced gradients are not reduced again."""
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    with strategy.scope():
        torch.manual_seed(0)
        model = make_model()
        opt = make_sgd(model.parameters())
    (x1, y1), (x2, y2) = global_batches([8, 8])
    batches = iter(strategy.experimental_distribute_dataset([(x1, y1), (x2, y2)]))

    def backward(x, y):
        (per_example(model(x), y).sum() / 16).backward()  # the mean over both global batches

    strategy.run(backward, args=next(batches))
    with strategy.scope():
        nn.Linear(2, 2)  # new parameters: the reducer is rebuilt between the two backward passes
    strategy.run(backward, args=next(batches))
    strategy.run(opt.step)
    return _flat(model).tolist()


@pytest.mark.timeout(120)
def test_accumulation_across_a_scope_reduces_each_gradient_once():
    torch.manual_seed(0)
    model = make_model()
    opt = make_sgd(model.parameters())
    for x, y in global_batches([8, 8]):
        (per_example(model(x), y).sum() / 16).backward()
    opt.step()
    want = _flat(model)
    for r in run_workers(accumulate_across_a_scope_worker, 2):
        torch.testing.assert_close(torch.tensor(r.value), want, rtol=1e-5, atol=1e-6)


def _freeze_then_unfreeze(model, opt, batches, run) -> None:
    """Fine-tuning's gradual unfreezing: a step with the first layer frozen, then two with it
    trainable (its parameters were in the optimizer all along)."""
    for i, (x, y) in enumerate(batches):
        for p in model[0].parameters():
            p.requires_grad_(i > 0)

        def step(x, y):
            opt.zero_grad()
            (per_example(model(x), y).sum() / 8).backward()
            opt.step()

        run(step, x, y)


def unfreeze_worker() -> list[float]:
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    with strategy.scope():
        torch.manual_seed(0)
        model = make_model()
        model[0].requires_grad_(False)  # frozen when the scope closes
        opt = make_sgd(model.parameters())
    batches = list(strategy.experimental_distribute_dataset(global_batches([8, 8, 8])))
    _freeze_then_unfreeze(model, opt, batches, lambda f, x, y: strategy.run(f, args=(x, y)))
    return _flat(model).tolist()


@pytest.mark.timeout(120)
def test_a_layer_unfrozen_after_the_scope_has_its_gradients_reduced():
    torch.manual_seed(0)
    model = make_model()
    opt = make_sgd(model.parameters())
    _freeze_then_unfreeze(model, opt, global_batches([8, 8, 8]), lambda f, x, y: f(x, y))
    want = _flat(model)
    got = [torch.tensor(r.value) for r in run_workers(unfreeze_worker, 2)]
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)  # replicas stay identical
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
