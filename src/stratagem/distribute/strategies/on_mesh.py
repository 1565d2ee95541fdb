"""``strategy_on_mesh``: several parallelisms asked for at once, as a mesh with named axes plus the
plans that apply to the model (torchtitan's ``ParallelDims``, Keras 3's ``DeviceMesh`` +
``LayoutMap``).

The mesh's axes say what composes: ``"data"`` (or HSDP's ``"data_replicate"`` x
``"data_shard"``), ``"pipeline"`` and the tensor axis (``"model"``), outermost first as torchtitan
lays them out (``dp x pp x tp``: a stage's tensor-parallel processes are consecutive ranks). The
plans: ``layout_map`` (which weights split along the tensor axis), ``sharding`` (FSDP over the
data axis, with ShardedStrategy's options) and ``pipeline`` (the schedule over the pipeline
axis). The answer is the preset that runs that composition, configured with the mesh's
degrees, so everything the preset's docs say holds:

=========================================  ===========================================
mesh axes (plans)                          strategy
=========================================  ===========================================
data                                       MirroredStrategy(num_replicas=D)
data (sharding)                            ShardedStrategy(num_replicas=D, ...)
data_replicate x data_shard (sharding)     ShardedStrategy(shard_size=S): HSDP
[data x] model (layout_map[, sharding])    ModelParallelStrategy: TP, FSDP x TP
data_replicate x data_shard x model        ModelParallelStrategy(shard_size=S): HSDP x TP
[data x] pipeline [x model] (pipeline)     PipelineStrategy(K, M, data_parallel=D, ...)
=========================================  ===========================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stratagem.core.mesh import DATA, DATA_REPLICATE, DATA_SHARD, PIPELINE, DeviceMesh
from stratagem.distribute.engines.fsdp import ShardingOptions
from stratagem.distribute.engines.layout import LayoutMap
from stratagem.distribute.strategy import Strategy


@dataclass(frozen=True)
class PipelineOptions:
    """The schedule over a mesh's ``"pipeline"`` axis: PipelineStrategy's arguments."""

    num_microbatches: int
    schedule: str = "gpipe"
    rematerialize: str = "auto"
    balance: Sequence[int] | str | None = None
    virtual_stages: int | None = None


def strategy_on_mesh(
    mesh: DeviceMesh,
    layout_map: LayoutMap | None = None,
    *,
    sharding: ShardingOptions | None = None,
    pipeline: PipelineOptions | None = None,
    model_axis: str = "model",
    devices: str | None = None,
    timeout: float = 120.0,
) -> Strategy:
    """The strategy that runs ``mesh``'s composition (see the module's table)::

        mesh = sg.DeviceMesh((2, 2, 2), ("data", "pipeline", "model"))
        layout_map = sg.LayoutMap(mesh)
        layout_map[r"mlp\\.c_fc\\.weight"] = ("model", None)
        strategy = sg.strategy_on_mesh(mesh, layout_map, sharding=sg.ShardingOptions(),
                                       pipeline=sg.PipelineOptions(num_microbatches=4, schedule="1f1b"))

    Errors name what the mesh or plans lack before any process starts."""
    what = "strategy_on_mesh"
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: mesh must be a stratagem.DeviceMesh, got {type(mesh).__name__}: {mesh!r}")
    known = (DATA, DATA_REPLICATE, DATA_SHARD, PIPELINE, model_axis)
    unknown = [a for a in mesh.axis_names if a not in known]
    if unknown:
        raise ValueError(
            f"{what}: mesh {mesh} has axes {unknown} it cannot place: name them from "
            f"{list(known)} (data parallel, HSDP's two, pipeline stages, tensor parallel)"
        )
    expected = _outermost_first(mesh.axis_names)
    if list(mesh.axis_names) != expected:
        raise ValueError(
            f"{what}: mesh {mesh} lists its axes as {mesh.axis_names}; give them outermost first as "
            f"{tuple(expected)} (data, then pipeline, then the tensor axis: torchtitan's order)"
        )
    hsdp = DATA_REPLICATE in mesh.axis_names or DATA_SHARD in mesh.axis_names
    if hsdp and DATA in mesh.axis_names:
        raise ValueError(f"{what}: mesh {mesh} has both 'data' and HSDP's axes; use one or the other")
    if hsdp and not (DATA_REPLICATE in mesh.axis_names and DATA_SHARD in mesh.axis_names):
        raise ValueError(f"{what}: mesh {mesh}: HSDP takes both 'data_replicate' and 'data_shard'")
    if hsdp and sharding is None:
        raise ValueError(f"{what}: mesh {mesh} has HSDP's axes; pass sharding=stratagem.ShardingOptions(...)")
    if sharding is not None and sharding.shard_size is not None:
        raise ValueError(
            f"{what}: give HSDP as the mesh's 'data_replicate' x 'data_shard' axes, not "
            f"ShardingOptions(shard_size={sharding.shard_size})"
        )
    stages = mesh.axis_size(PIPELINE)
    replicas = mesh.axis_size(DATA) * mesh.axis_size(DATA_REPLICATE) * mesh.axis_size(DATA_SHARD)
    shard_size = mesh.axis_size(DATA_SHARD) if hsdp else None
    if layout_map is not None:
        if not isinstance(layout_map, LayoutMap):
            raise TypeError(f"{what}: layout_map must be a stratagem.LayoutMap, got {type(layout_map).__name__}")
        if layout_map.mesh != mesh:
            raise ValueError(f"{what}: the layout map is for mesh {layout_map.mesh}, not {mesh}")
    if layout_map is not None and model_axis not in mesh.axis_names:
        raise ValueError(
            f"{what}: a layout map splits weights along {model_axis!r}, an axis mesh {mesh} lacks; add "
            f"it to the mesh (or pass model_axis= its name), or leave layout_map=None"
        )
    if model_axis in mesh.axis_names and layout_map is None:
        raise ValueError(f"{what}: mesh {mesh} has a {model_axis!r} axis; pass the layout_map that splits along it")
    if (PIPELINE in mesh.axis_names) != (pipeline is not None):
        raise ValueError(
            f"{what}: a 'pipeline' axis and pipeline=PipelineOptions(...) go together (mesh {mesh}, "
            f"pipeline={pipeline!r})"
        )
    common: dict[str, Any] = {"devices": devices, "timeout": timeout}
    if hsdp:  # the presets take HSDP as one data axis and shard_size
        assert sharding is not None
        sharding = dataclasses.replace(sharding, shard_size=shard_size)
        mesh, layout_map = _one_data_axis(mesh, layout_map, replicas)
    if pipeline is not None:
        from stratagem.distribute.strategies.pipeline import PipelineStrategy

        return PipelineStrategy(
            stages, pipeline.num_microbatches, schedule=pipeline.schedule, rematerialize=pipeline.rematerialize,
            balance=pipeline.balance, virtual_stages=pipeline.virtual_stages, data_parallel=replicas,
            sharding=sharding, layout_map=layout_map, model_axis=model_axis, **common,
        )  # fmt: skip
    if model_axis in mesh.axis_names:
        from stratagem.distribute.strategies.tensor_parallel import ModelParallelStrategy

        assert layout_map is not None  # checked above
        return ModelParallelStrategy(mesh, layout_map, model_axis=model_axis, sharding=sharding, **common)
    if sharding is None:
        from stratagem.distribute.strategies.mirrored import MirroredStrategy

        return MirroredStrategy(devices, num_replicas=replicas, timeout=timeout)
    from stratagem.distribute.strategies.sharded import ShardedStrategy

    return ShardedStrategy(
        num_replicas=replicas, units=sharding.units, reshard_after_forward=sharding.reshard_after_forward,
        mixed_precision=sharding.mixed_precision, offload=sharding.offload,
        gradient_reduction=sharding.gradient_op, shard_size=shard_size, **common,
    )  # fmt: skip


def _one_data_axis(mesh: DeviceMesh, layout_map: LayoutMap | None, replicas: int) -> tuple[DeviceMesh, LayoutMap | None]:
    """``mesh`` with HSDP's two axes joined into one ``data`` axis (the ranks keep their places),
    and ``layout_map``'s rules over it."""
    axes: list[tuple[str, int]] = [(DATA, replicas)]
    axes += [(a, n) for a, n in zip(mesh.axis_names, mesh.shape) if a not in (DATA_REPLICATE, DATA_SHARD)]
    flat = DeviceMesh.of(*axes)
    if layout_map is None:
        return flat, None
    flat_map = LayoutMap(flat)
    for pattern, layout in layout_map.items():
        flat_map[pattern] = layout
    return flat, flat_map


def _outermost_first(axes: Sequence[str]) -> list[str]:
    """``axes`` in the order the presets lay them out: data (HSDP's replicate outside its shard),
    pipeline, then the tensor axis."""
    rank = {DATA: 0, DATA_REPLICATE: 0, DATA_SHARD: 1, PIPELINE: 2}
    return sorted(axes, key=lambda a: rank.get(a, 3))
