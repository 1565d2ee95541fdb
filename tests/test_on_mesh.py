"""strategy_on_mesh (issue 32): several parallelisms asked for at once as one mesh with named
axes plus the plans. Each mesh gives the preset that runs it, with the mesh's degrees, and trains
at parity with one device; what a mesh cannot say is a clear error before any process starts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.testing import run_workers
from stratagem.testing.contracts import train_reference, train_under

sys.path.insert(0, str(Path(__file__).parent / "sharded"))
import sharded_workers as w  # noqa: E402

TOL = 1e-5


def _layouts(mesh: sg.DeviceMesh) -> sg.LayoutMap:
    return w._layouts(mesh)


def _bad(diff: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in diff.items() if v > TOL}


def data_worker() -> dict[str, Any]:
    """("data",) alone is MirroredStrategy; with sharding= it is ShardedStrategy; both train the
    transformer of tests/sharded as one device does."""
    out: dict[str, Any] = {}
    batches = w.seq_batches(3)
    want = train_reference(w.make_transformer, w.make_adam, w.seq_mse, batches, seed=0)
    mesh = sg.DeviceMesh((2,), ("data",))
    for name, sharding in (("mirrored", None), ("sharded", sg.ShardingOptions(units=w.Block))):
        s = sg.strategy_on_mesh(mesh, sharding=sharding, devices="cpu")
        model, _ = train_under(s, w.make_transformer, w.make_adam, w.seq_mse, batches)
        out[name] = (type(s).__name__, s.num_replicas_in_sync, _bad(w.max_diff(w.full_state(model), want)))
    return out


@pytest.mark.timeout(240)
def test_a_data_axis_is_mirrored_and_with_sharding_sharded() -> None:
    for out in (r.value for r in run_workers(data_worker, 2, timeout=220)):
        assert out["mirrored"] == ("MirroredStrategy", 2, {})
        assert out["sharded"] == ("ShardedStrategy", 2, {})


def _pipe_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def pipeline_worker() -> dict[str, Any]:
    """("data", "pipeline") with sharding and PipelineOptions is pipeline x sharded: 2 stages x 2
    sharded copies, trained by the custom loop as one device on the global batch."""
    from torch.distributed.tensor import DTensor

    mesh = sg.DeviceMesh((2, 2), ("data", "pipeline"))
    s = sg.strategy_on_mesh(mesh, sharding=sg.ShardingOptions(),
                            pipeline=sg.PipelineOptions(num_microbatches=2, schedule="1f1b"), devices="cpu")  # fmt: skip
    loss_fn = nn.CrossEntropyLoss()
    with s.scope():
        torch.manual_seed(0)
        pipe = s.pipeline(_pipe_model(), loss_fn, verbose=False)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    torch.manual_seed(0)
    ref = _pipe_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    global_batches = [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    for x, y in s.experimental_distribute_dataset(global_batches):
        s.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()
    for gx, gy in global_batches:
        loss_fn(ref(gx), gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    state = pipe.state_dict()
    diff = {k: float((v - ref.state_dict()[k]).abs().max()) for k, v in state.items()}
    sharded = any(isinstance(p, DTensor) for p in pipe.parameters())
    return {"type": type(s).__name__, "stages": s.num_stages, "replicas": s.num_replicas_in_sync,
            "repr": repr(s), "sharded": sharded, "diff": _bad(diff)}  # fmt: skip


@pytest.mark.timeout(240)
def test_data_x_pipeline_with_sharding_is_pipeline_x_sharded_at_parity() -> None:
    for out in (r.value for r in run_workers(pipeline_worker, 4, timeout=220)):
        assert (out["type"], out["stages"], out["replicas"], out["sharded"]) == ("PipelineStrategy", 2, 2, True), out
        assert "schedule='1f1b'" in out["repr"] and "sharding=ShardingOptions(" in out["repr"]
        assert out["diff"] == {}, out["diff"]


def hsdp_tensor_worker() -> dict[str, Any]:
    """("data_replicate", "data_shard", "model") is HSDP x TP on 8 processes (docs/STRATEGIES.md's
    lines, as written)."""
    import stratagem

    Block = w.Block
    mesh = stratagem.DeviceMesh((2, 2, 2), ("data_replicate", "data_shard", "model"))
    layout_map = _layouts(mesh)
    strategy = stratagem.strategy_on_mesh(mesh, layout_map, sharding=stratagem.ShardingOptions(units=Block))
    s = strategy
    batches = w.seq_batches(3, size=8)
    model, _ = train_under(s, w.make_transformer, w.make_adam, w.seq_mse, batches)
    want = train_reference(w.make_transformer, w.make_adam, w.seq_mse, batches, seed=0)
    return {"type": type(s).__name__, "replicas": s.num_replicas_in_sync,
            "mesh": model[0].q.weight.device_mesh.mesh_dim_names, "diff": _bad(w.max_diff(w.full_state(model), want))}  # fmt: skip


@pytest.mark.slow  # 8 processes: the slow tier (CI runs it)
@pytest.mark.timeout(300)
def test_hsdp_axes_with_a_model_axis_are_hsdp_x_tensor_at_parity() -> None:
    for out in (r.value for r in run_workers(hsdp_tensor_worker, 8, timeout=280)):
        assert (out["type"], out["replicas"]) == ("ModelParallelStrategy", 4)
        assert out["mesh"] == ("data_replicate", "data_shard", "model")
        assert out["diff"] == {}, out["diff"]


@pytest.mark.parametrize(
    "axes, kwargs, message",
    [
        (((2, "data"), (2, "expert")), {}, r"axes \['expert'\] it cannot place"),
        (((2, "model"), (2, "data")), {"layout": True}, r"give them outermost first as \('data', 'model'\)"),
        (((2, "data"), (2, "model")), {}, "has a 'model' axis; pass the layout_map"),
        (((2, "data"), (2, "pipeline")), {}, r"a 'pipeline' axis and pipeline=PipelineOptions\(...\) go together"),
        (((2, "data"),), {"pipeline": True}, r"a 'pipeline' axis and pipeline=PipelineOptions\(...\) go together"),
        (((2, "data_replicate"), (2, "data_shard")), {}, "has HSDP's axes; pass sharding="),
        (((2, "data_shard"),), {"sharding": True}, "HSDP takes both 'data_replicate' and 'data_shard'"),
        (((2, "data"), (2, "data_replicate"), (2, "data_shard")), {"sharding": True}, "both 'data' and HSDP's axes"),
        (((4, "data"),), {"shard_size": 2}, r"not ShardingOptions\(shard_size=2\)"),
        (((2, "data"), (2, "pipeline")), {"pipeline": True, "layout": True}, "an axis mesh .* lacks"),
    ],
)
def test_what_a_mesh_cannot_say_is_a_clear_error_before_any_process_starts(
    axes: tuple[tuple[int, str], ...], kwargs: dict[str, Any], message: str
) -> None:
    mesh = sg.DeviceMesh(tuple(n for n, _ in axes), tuple(a for _, a in axes))
    call: dict[str, Any] = {"devices": "cpu"}
    if kwargs.get("sharding") or kwargs.get("shard_size"):
        call["sharding"] = sg.ShardingOptions(shard_size=kwargs.get("shard_size"))
    if kwargs.get("pipeline"):
        call["pipeline"] = sg.PipelineOptions(num_microbatches=2)
    layout = sg.LayoutMap(mesh) if kwargs.get("layout") else None
    with pytest.raises(ValueError, match=message):
        sg.strategy_on_mesh(mesh, layout, **call)
    other = sg.DeviceMesh((2, 2), ("data", "model"))
    with pytest.raises(ValueError, match="the layout map is for mesh"):
        sg.strategy_on_mesh(other, sg.LayoutMap(sg.DeviceMesh((4, 1), ("data", "model"))), devices="cpu")
