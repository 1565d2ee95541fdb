"""Tensor x sharded (issue 32): ModelParallelStrategy on a ("data", "model") mesh shards the
tensor-parallel model over "data" unit by unit with ShardedStrategy's options
(``sharding=sg.ShardingOptions(...)``), trains at parity with one device (custom loop and fit),
and its checkpoints resume bit for bit and load into one plain process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import stratagem
from stratagem.testing import run_workers
from stratagem.testing.contracts import train_reference

sys.path.insert(0, str(Path(__file__).parent))
import sharded_workers as w  # noqa: E402
import tensor_x_sharded_workers as tx  # noqa: E402

TOL = 1e-5
STEPS = 4


def _bad(diff: dict[str, float], tol: float = TOL) -> dict[str, float]:
    return {k: v for k, v in diff.items() if v > tol}


@pytest.mark.timeout(240)
def test_per_unit_options_custom_loop_equals_one_device() -> None:
    outs = [r.value for r in run_workers(tx.custom_loop, 4, args=(STEPS,), timeout=220)]
    for out in outs:
        assert sorted(out["units"]) == ["0", "1", "<root>"]
        assert out["plan"] == "units: 0 1 + root"
        assert out["reshard_after_forward"] == [False, False]  # the option reached each unit
        # split over "model" (rows of q) and sharded over "data": a quarter of q's rows here
        assert "Shard(dim=0), Shard(dim=0)" in out["q_placements"] or "_StridedShard" in out["q_placements"]
        assert out["local_q_shape"] == (w.D // 4, w.D)
        assert not _bad(out["diff"]), f"tensor x sharded differs from one device: {_bad(out['diff'])}"
    assert len({tuple(o["losses"]) for o in outs}) == 1  # every process reports the same losses


@pytest.mark.slow  # in the slow tier (CI runs it): the main tier under 15 minutes
@pytest.mark.timeout(240)
def test_mean_gradient_op_with_a_per_replica_mean_loss_equals_one_device() -> None:
    for out in (r.value for r in run_workers(tx.mean_reduction, 4, args=(STEPS,), timeout=220)):
        assert sorted(out["units"]) == ["0", "1", "<root>"]  # the default plan: each block
        assert not _bad(out["diff"]), f"gradient_op='mean' differs from one device: {_bad(out['diff'])}"


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_fit_checkpoint_resume_is_exact_and_one_process_restores(tmp_path: Path) -> None:
    outs = [r.value for r in run_workers(tx.fit_and_resume, 4, args=(str(tmp_path), STEPS), timeout=220)]
    for out in outs:
        assert not _bad(out["diff"]), f"fit under tensor x sharded differs from one device: {_bad(out['diff'])}"
        assert out["resumed_vs_straight"] == 0.0  # restored mid-training: bit for bit
        # gradient accumulation (3 batches per update): one device's parameters, and nothing
        # reduce-scattered before each update's last micro-step
        assert not _bad({"accumulated": out["accum_diff"]})
        assert out["update_reduce_scatters"] > 0
        assert out["accum_reduce_scatters"] == 2 * out["update_reduce_scatters"], out
    # the checkpoint of the 2 x 2 mesh loads into a plain transformer here and trains on at parity
    _restore_in_one_process_and_train_on(outs[0]["ckpt"], w.seq_batches(STEPS))


def _restore_in_one_process_and_train_on(ckpt: str, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``ckpt`` (saved half way through ``batches``) restored into a plain transformer with its
    optimizer, trained on the second half here: one device's parameters after all of them."""
    torch.manual_seed(5)
    model = w.make_transformer()
    opt = w.make_adam(model.parameters())
    stratagem.CheckpointManager(stratagem.Checkpoint(model=model, optimizer=opt), Path(ckpt).parent).restore(ckpt)
    for x, y in batches[STEPS // 2 :]:
        opt.zero_grad()
        w.seq_mse(model(x), y).mean().backward()
        opt.step()
    want = train_reference(w.make_transformer, w.make_adam, w.seq_mse, batches, seed=0)
    assert not _bad(w.max_diff(model.state_dict(), want))


@pytest.mark.slow  # in the slow tier (CI runs it): the main tier under 15 minutes
@pytest.mark.timeout(240)
def test_mixed_precision_computes_in_bf16_and_stays_near_fp32() -> None:
    for out in (r.value for r in run_workers(tx.mixed_precision, 4, args=(STEPS,), timeout=220)):
        assert out["dtypes"] == ["torch.bfloat16"]  # gathered for compute in bf16
        assert out["stored"] == "torch.float32"  # kept in fp32 between steps
        assert out["relative"] < 1e-2, out["relative"]  # bf16 arithmetic: each loss near, not equal


def test_sharding_it_cannot_take_is_a_clear_error() -> None:
    from stratagem.distribute import DeviceMesh, LayoutMap, ModelParallelStrategy

    flat = DeviceMesh((2,), ("model",))
    with pytest.raises(ValueError, match="no such axis with 2 or more processes"):
        ModelParallelStrategy(flat, LayoutMap(flat), devices="cpu", sharding=stratagem.ShardingOptions())
    mesh = DeviceMesh((2, 2), ("data", "model"))
    with pytest.raises(ValueError, match=r"shard_size=3\) must divide the 2 processes of the batch axis 'data'"):
        ModelParallelStrategy(mesh, LayoutMap(mesh), devices="cpu", sharding=stratagem.ShardingOptions(shard_size=3))
    taken = DeviceMesh((2, 2), ("data_shard", "model"))
    with pytest.raises(ValueError, match="names mesh .* already uses"):
        ModelParallelStrategy(taken, LayoutMap(taken), batch_axis="data_shard", devices="cpu",
                              sharding=stratagem.ShardingOptions(shard_size=1))
    with pytest.raises(ValueError, match="must be a stratagem.ShardingOptions"):
        ModelParallelStrategy(mesh, LayoutMap(mesh), devices="cpu", sharding={"units": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gradient_op must be 'sum' or 'mean'"):
        ModelParallelStrategy(mesh, LayoutMap(mesh), devices="cpu", sharding=stratagem.ShardingOptions(gradient_op="avg"))


@pytest.mark.slow  # 8 processes: the slow tier (CI runs it)
@pytest.mark.timeout(300)
def test_hsdp_x_tensor_on_8_processes_equals_one_device_and_restores_in_one_process(tmp_path: Path) -> None:
    outs = [r.value for r in run_workers(tx.hsdp_x_tensor, 8, args=(str(tmp_path), STEPS), timeout=280)]
    for out in outs:
        assert out["replicas"] == 4  # the batch is split over the whole data axis
        assert out["mesh"] == "('data_replicate', 'data_shard', 'model')"
        assert out["q_placements"].count("Replicate()") == 1, out["q_placements"]  # replicated across pairs
        assert out["local_q_shape"] == (w.D // 4, w.D)  # rows split over "model", then over a pair
        assert sorted(out["units"]) == ["0", "1", "<root>"]
        assert not _bad(out["diff"]), f"HSDP x TP differs from one device: {_bad(out['diff'])}"
        assert not _bad(out["fit_diff"]), f"fit under HSDP x TP differs from one device: {_bad(out['fit_diff'])}"
    assert len({tuple(o["losses"]) for o in outs}) == 1
    _restore_in_one_process_and_train_on(outs[0]["ckpt"], w.seq_batches(STEPS, size=8))
