"""ShardedStrategy (FSDP2): parity with one device, memory per rank, fit, checkpoints across world sizes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import stratagem
from stratagem.distribute.engines.shard_plan import UnitPlan, plan_units
from stratagem.testing import run_workers
from stratagem.testing.contracts import train_reference

sys.path.insert(0, str(Path(__file__).parent))
import sharded_workers as w  # noqa: E402

TOL = 1e-5


# --- the unit plan is data -------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 4)
        self.blocks = nn.ModuleList([Block(), Block(), nn.ReLU()])
        self.head = nn.Linear(4, 1)


def test_unit_plans() -> None:
    net = Net()
    assert plan_units(net) == UnitPlan(("blocks.0", "blocks.1"))
    assert str(plan_units(net)) == "units: blocks.0 blocks.1 + root"
    assert plan_units(net, Block) == UnitPlan(("blocks.0", "blocks.1"))
    assert plan_units(net, nn.Linear).units == ("embed", "blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.1.b", "head")
    assert plan_units(net, 40) == UnitPlan(("blocks.0", "blocks.1"))  # 40 params per block
    assert plan_units(net, 10_000) == UnitPlan(())
    assert plan_units(nn.Linear(3, 3)) == UnitPlan(())
    assert str(plan_units(nn.Linear(3, 3))) == "units: root"
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_units(net, 0)
    with pytest.raises(TypeError, match="units must be"):
        plan_units(net, "blocks")  # type: ignore[arg-type]


def _assert_replay_is_single_device_init(model, modules, rng, make, *, seed: int) -> None:
    """Materializing the captured ``modules`` gives ``model`` the values ``make()`` gives on one
    device from ``seed``, and leaves the random state where that construction leaves it."""
    from stratagem.distribute.engines.meta_init import materialize

    model.to_empty(device="cpu")
    materialize(modules, rng, torch.device("cpu"))
    after = torch.rand(3)
    torch.manual_seed(seed)
    want = make()
    assert torch.equal(after, torch.rand(3))
    for (name, got), ref in zip(model.state_dict().items(), want.state_dict().values()):
        assert torch.equal(got, ref), name


def test_meta_build_replays_single_device_init() -> None:
    """Built on meta, materialized module by module: the values one device gives, and the
    random state after it (no process group needed: plain tensors keep all of their part)."""
    from stratagem.distribute.engines.meta_init import MetaCapture

    def make() -> nn.Module:
        return nn.Sequential(
            nn.Embedding(7, 4), nn.Linear(4, 6), nn.LayerNorm(6), nn.Conv1d(6, 3, 2),
            nn.BatchNorm1d(3), nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)),
        )  # fmt: skip

    cap = MetaCapture()
    torch.manual_seed(3)
    with cap.capture():
        model = make()
    assert all(p.is_meta for p in model.parameters())
    modules, rng = cap.take()
    assert cap.roots(modules) == [model]
    _assert_replay_is_single_device_init(model, modules, rng, make, seed=3)


def test_meta_build_replays_modules_dropped_in_the_scope() -> None:
    """A layer replaced in the scope (a new head, as when fine-tuning) and a module made and
    dropped there drew random numbers on one device: the replay draws them too, so what is
    kept, and the random state after, equal single-device initialisation."""
    import gc

    from stratagem.distribute.engines.meta_init import MetaCapture

    def build() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
        model[2] = nn.Linear(6, 2)  # the old head is freed at once
        nn.Linear(5, 5)  # made and dropped
        cyclic = nn.Linear(3, 5)
        cyclic.cycle = [cyclic]  # type: ignore[assignment]  # freed only when the collector runs
        del cyclic
        gc.collect()
        model.extra = nn.Linear(2, 2)
        return model

    cap = MetaCapture()
    torch.manual_seed(5)
    with cap.capture():
        model = build()
    modules, rng = cap.take()
    roots = cap.roots(modules)
    # the dropped layers are replayed, not sharded; one kept alive by a reference cycle is
    # sharded like a model (wasted work, never a different set on another replica)
    assert roots[0] is model and [tuple(r.weight.shape) for r in roots[1:]] == [(5, 3)]
    _assert_replay_is_single_device_init(model, modules, rng, build, seed=5)


# --- 2 processes -----------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_sharded_two_processes(tmp_path: Path) -> None:
    results = run_workers(w.two_processes, 2, args=(str(tmp_path),), timeout=140)
    outs = [r.value for r in results]
    for out in outs:
        assert out["param_type"] == "DTensor"
        assert out["init_diff"] == 0.0  # bit-identical to single-device init from the same seed
        assert out["plan"] == "units: 0 2 4 6 + root"
        bad = {k: v for k, v in out["adam_diff"].items() if v > TOL}
        assert not bad, f"parameters differ from single-device training: {bad}"
        # params + grads + Adam state held here: at most 1/N of the unsharded total + 10%
        assert out["bytes"] <= out["reference_bytes"] / out["n"] * 1.10, (out["bytes"], out["reference_bytes"])
        assert out["dfn_sum"] == (0 + 1 + 2 + 3) + (10 + 11 + 12 + 13)
        assert out["gather"] == [0.0, 1.0, 1.0]
        loss, want_loss, mae, want_mae = out["fit_eval"]
        assert loss == pytest.approx(want_loss, rel=1e-6) and mae == pytest.approx(want_mae, rel=1e-6)
        assert out["fit_pred_diff"] < TOL and out["fit_diff"] < TOL and out["fit_epochs"] == 2
        # gradient accumulation: one device's update on the batches joined; the micro-steps
        # before each update's last reduce nothing (2 updates: twice one update's reduce-scatters)
        assert out["accum_diff"] < TOL
        assert out["update_reduce_scatters"] > 0
        assert out["accum_reduce_scatters"] == 2 * out["update_reduce_scatters"], out
        assert out["ckpt_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one part per rank
        assert out["mirrored_restored_diff"] == 0.0 and out["mirrored_adam_steps"] == [6]
        assert out["from_mirrored_diff"] == 0.0 and out["from_mirrored_step"] == 3
        assert out["from_mirrored_continued"] < TOL
        assert out["fresh_state_after_save"] == 0
        assert out["restored_from"] == "ckpt-3" and out["restored_step"] == 3
        assert out["restored_diff"] == 0.0 and out["continued_diff"] == 0.0
        assert out["keep_gathered_diff"] < TOL and out["keep_gathered_plan"] == "units: 0 2 4 6 + root"
        assert set(out["keep_gathered_reshards"].values()) == {False}, out["keep_gathered_reshards"]
        # by default as fully_shard by hand: each unit freed after its forward, the root kept for
        # the backward right after (passing True made the root gather again: one more all-gather)
        assert out["default_units_diff"] < TOL
        assert out["default_units_reshards"] == {"<root>": False, "0": True, "2": True, "4": True}, out
        assert out["offload_diff"] < TOL and out["offload_plan"] == "units: 0 2 4 + root"
        assert out["resumed_diff"] < TOL and out["resumed_epochs"] == 3  # BackupAndRestore resumed exactly
        errors = out["errors"]
        assert "Scale holds parameters ['w'] but has no reset_parameters()" in errors["no_reset"]
        assert "Linear's parameters ['weight'] were written after its reset_parameters()" in errors["rewritten"]
        assert out["auto_init_diff"] == 0.0  # built on the host: one device's initial values
        assert "created outside ShardedStrategy.scope()" in errors["outside_run"]
        assert "was not created in the scope of ShardedStrategy" in errors["outside_fit"]
        assert out["bf16_diff"] < 5e-2 and out["bf16_dtype"] == "torch.float32"  # master weights fp32
    assert outs[0]["bytes"] < outs[0]["reference_bytes"] * 0.6


@pytest.mark.slow
# --- 4 processes, then 2 and 1 from its checkpoint -------------------------------------------------
@pytest.mark.timeout(200)
def test_sharded_four_processes_and_resharded_restore(tmp_path: Path) -> None:
    before, after = 3, 2
    # large allocations mmapped (and so unmapped when freed): resident memory then measures the
    # tensors alive, not what glibc's per-thread arenas (gloo's threads) keep after a free
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    outs = [r.value for r in run_workers(w.four_processes, 4, args=(str(tmp_path), before), timeout=190, env=env)]
    ref_bytes = w.reference_bytes()
    for out in outs:
        bad = {k: v for k, v in out["adam_diff"].items() if v > TOL}
        assert not bad, f"4 processes differ from single-device training: {bad}"
        assert out["bytes"] <= ref_bytes / 4 * 1.10, (out["bytes"], ref_bytes)
        full = out["big_full_bytes"]
        # the budget a process has: 80% of the full parameters (resident memory, measured per
        # phase). Building holds a quarter plus one layer whole; a step adds a quarter of
        # gradients and one unit gathered at a time; saving streams the shards.
        budget = 0.8 * full
        assert out["big_build_peak"] < 0.5 * full, out
        assert out["big_step_peak"] < budget, out
        assert out["big_save_peak"] < budget, out
        assert out["big_local_param_bytes"] <= full / 4 * 1.01
        assert out["big_grad_bytes"] <= full / 4 * 1.01
        # built on the host (init="auto"): the peak is one full copy (the documented cost), and
        # once sharded the full copy is freed, even though the optimizer made in the scope held it
        assert out["host_build_peak"] < 1.3 * full, out
        assert out["host_after_build"] < 0.4 * full, out
        assert out["host_local_param_bytes"] <= full / 4 * 1.01
        assert out["host_init_diff"] == 0.0
        # HSDP: each pair of processes holds one sharded copy (1/2 each), the pairs replicate
        bad = {k: v for k, v in out["hsdp_diff"].items() if v > TOL}
        assert not bad, f"HSDP differs from single-device training: {bad}"
        assert out["hsdp_bytes"] <= ref_bytes / 2 * 1.10, (out["hsdp_bytes"], ref_bytes)
        assert out["hsdp_placements"] == "(Replicate(), Shard(dim=0))"
        # 2-D mesh (data x model): tensor parallel inside each replica, FSDP across the two
        assert out["mesh2d_replicas"] == 2 and out["mesh2d_init_diff"] == 0.0
        bad = {k: v for k, v in out["mesh2d_adam_diff"].items() if v > TOL}
        assert not bad, f"the 2-D mesh differs from single-device training: {bad}"
    assert [o["mesh2d_replica"] for o in outs] == [0, 0, 1, 1]
    ckpt = outs[0]["ckpt"]

    # into 2 processes: training continues at parity
    twos = [r.value for r in run_workers(w.fewer_processes, 2, args=(ckpt, before, after), timeout=120)]
    for out in twos:
        bad = {k: v for k, v in out["diff"].items() if v > TOL}
        assert not bad, f"restored on 2 processes, training differs: {bad}"

    # into one plain process (no strategy, no process group): a plain model and optimizer
    torch.manual_seed(7)
    model = w.make_mlp()
    opt = w.make_adam(model.parameters())
    stratagem.CheckpointManager(stratagem.Checkpoint(model=model, optimizer=opt), Path(ckpt).parent).restore(ckpt)
    batches = w.global_batches(before + after)
    for x, y in batches[before:]:
        opt.zero_grad()
        w.mse(model(x), y).mean().backward()
        opt.step()
    want = train_reference(w.make_mlp, w.make_adam, w.mse, batches, seed=0)
    bad = {k: v for k, v in w.max_diff(model.state_dict(), want).items() if v > TOL}
    assert not bad, f"restored in one plain process, training differs: {bad}"


# --- mesh layouts and tensor parallelism ---------------------------------------------------------
def test_mesh_and_layout_map() -> None:
    from stratagem.distribute import DeviceMesh, LayoutMap
    from stratagem.distribute.engines.layout import tensor_parallel_plan

    mesh = DeviceMesh((2, 3), ("data", "model"))
    assert mesh.size == 6 and mesh.axis_size("model") == 3 and mesh.axis_size("pipe") == 1
    assert mesh.coordinates(4) == {"data": 1, "model": 1}
    assert mesh.groups("data") == [[0, 3], [1, 4], [2, 5]]
    assert mesh.groups("model") == [[0, 1, 2], [3, 4, 5]]
    layout = LayoutMap(mesh)
    layout[r"\.(q|k|v|w1)\.weight$"] = ("model", None)
    layout[r"\.(o|w2)\.weight$"] = (None, "model")
    assert layout["0.q.weight"] == ("model", None) and layout["0.q.bias"] is None
    plan = tensor_parallel_plan(w.make_transformer(), layout)
    assert plan == {
        f"{i}.{n}": kind for i in (0, 1) for n, kind in
        (("q", "colwise"), ("k", "colwise"), ("v", "colwise"), ("o", "rowwise"), ("w1", "colwise"), ("w2", "rowwise"))
    }  # fmt: skip
    with pytest.raises(ValueError, match="not in the mesh"):
        layout["x"] = ("tensor",)
    layout[r"norm1\.weight"] = ("model",)
    with pytest.raises(ValueError, match="only the weights of Linear and Embedding"):
        tensor_parallel_plan(w.make_transformer(), layout)
    with pytest.raises(ValueError, match="has 2 axes but axis_names"):
        DeviceMesh((2, 2), ("model",))


@pytest.mark.timeout(120)
def test_tensor_parallel_two_processes(tmp_path: Path) -> None:
    steps = 3
    outs = [r.value for r in run_workers(w.tensor_parallel, 2, args=(str(tmp_path), steps), timeout=110)]
    for out in outs:
        assert out["replicas"] == 1  # both processes run one replica, split along "model"
        assert out["plan"]["0.q"] == "colwise" and out["plan"]["1.w2"] == "rowwise"
        assert out["init_diff"] == 0.0
        assert out["local_q_rows"] == w.D // 2
        bad = {k: v for k, v in out["adam_diff"].items() if v > TOL}
        assert not bad, f"tensor-parallel training differs from one device: {bad}"
    assert outs[0]["eval_loss"] == outs[1]["eval_loss"]
    # the tensor-parallel checkpoint loads into a plain transformer in this process
    torch.manual_seed(5)
    model = w.make_transformer()
    opt = w.make_adam(model.parameters())
    ckpt = outs[0]["ckpt"]
    stratagem.CheckpointManager(stratagem.Checkpoint(model=model, optimizer=opt), Path(ckpt).parent).restore(ckpt)
    want = train_reference(w.make_transformer, w.make_adam, w.seq_mse, w.seq_batches(steps), seed=0)
    bad = {k: v for k, v in w.max_diff(model.state_dict(), want).items() if v > TOL}
    assert not bad, f"restored in one plain process: {bad}"
    x, y = w.seq_batches(1, seed=11)[0]
    with torch.no_grad():
        assert torch.isfinite(w.seq_mse(model(x), y)).all()


@pytest.mark.parametrize("init", ["meta", "auto", "materialize"])
def test_a_failed_scope_leaves_nothing_for_the_next_one(init: str) -> None:
    """What a scope that raised had captured is neither built nor replayed by the next scope:
    the next model still equals single-device initialisation from the same seed."""
    s = stratagem.ShardedStrategy(devices="cpu", init=init)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="on purpose"):
        with s.scope():
            half_built = nn.Linear(4, 4)
            raise RuntimeError("on purpose")
    torch.manual_seed(1)
    with s.scope():
        model = nn.Linear(4, 3)
    torch.manual_seed(1)
    want = nn.Linear(4, 3)
    assert half_built.weight.is_meta == (init == "meta")
    assert torch.equal(model.weight.full_tensor(), want.weight)
    assert torch.equal(model.bias.full_tensor(), want.bias)


def test_init_names_what_it_accepts() -> None:
    with pytest.raises(ValueError, match="ShardedStrategy: init must be one of 'auto', 'materialize', 'meta'; got 'lazy'"):
        stratagem.ShardedStrategy(devices="cpu", init="lazy")
