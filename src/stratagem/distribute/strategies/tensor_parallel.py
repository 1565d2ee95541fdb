"""ModelParallelStrategy: layers split over a DeviceMesh's "model" axis by a LayoutMap (Keras 3's ModelParallel).

``mesh = DeviceMesh((2,), ("model",))``, ``layout_map = LayoutMap(mesh)``,
``layout_map[r"attn\\.(q|k|v)\\.weight"] = ("model", None)``, then
``ModelParallelStrategy(mesh, layout_map)``: the model built in its scope is split as the map
says (torch's ``parallelize_module`` on DTensor). With a 2-D mesh ``("data", "model")`` the batch
is split over ``batch_axis`` too, and the model sharded over it (FSDP x TP), unit by unit as
ShardedStrategy shards: ``sharding=ShardingOptions(units=..., reshard_after_forward=...,
mixed_precision=..., offload=..., gradient_op=...)`` takes ShardedStrategy's options (None: its
defaults). ``init``: as for
ShardedStrategy (``"auto"``/``"materialize"``: built on the host as on one device, then split;
``"meta"``: built on the meta device, each shard initialised by replaying ``reset_parameters()``).
"""

from __future__ import annotations

from typing import final

from stratagem.core.mesh import DATA_REPLICATE, DATA_SHARD
from stratagem.distribute.engines.build import check_init
from stratagem.distribute.engines.fsdp import ShardingOptions
from stratagem.distribute.engines.layout import DeviceMesh, LayoutMap
from stratagem.distribute.engines.tensor_parallel import TensorParallelExtended
from stratagem.distribute.startup import start
from stratagem.distribute.strategy import Strategy


@final
class ModelParallelStrategy(Strategy):
    """One process per mesh position; ``layout_map`` says which weights split along ``model_axis``."""

    def __init__(
        self,
        mesh: DeviceMesh,
        layout_map: LayoutMap,
        *,
        batch_axis: str | None = "data",
        model_axis: str = "model",
        timeout: float = 120.0,
        devices: str | None = None,
        init: str = "auto",
        sharding: ShardingOptions | None = None,
    ) -> None:
        check_init(init, "ModelParallelStrategy")
        if layout_map.mesh != mesh:
            raise ValueError(f"ModelParallelStrategy: the layout map is for mesh {layout_map.mesh}, not {mesh}")
        _check_sharding(sharding, mesh, batch_axis)
        started = start("ModelParallelStrategy", devices, timeout=timeout, mesh=mesh)
        self.cluster_spec = started.spec
        self.device = started.device
        job = started.mesh(_job_layout(mesh, batch_axis, sharding))
        super().__init__(
            TensorParallelExtended(
                job, mesh, layout_map, model_axis=model_axis, batch_axis=batch_axis, name="ModelParallelStrategy",
                init=init, sharding=sharding or ShardingOptions(),
            )
        )


def _job_layout(mesh: DeviceMesh, batch_axis: str | None, sharding: ShardingOptions | None) -> DeviceMesh:
    """The job's mesh: the user's, or with ``shard_size`` (HSDP x TP) its batch axis cut into
    ``data_replicate`` x ``data_shard``, as ShardedStrategy(shard_size=...) lays out HSDP."""
    if sharding is None or batch_axis is None:
        return mesh
    return mesh.with_hsdp(batch_axis, sharding.shard_size)


def _check_sharding(sharding: object, mesh: DeviceMesh, batch_axis: str | None) -> None:
    """What ``sharding=`` can be on ``mesh``, or a ValueError saying why not."""
    if sharding is None:
        return
    if not isinstance(sharding, ShardingOptions):
        raise ValueError(
            f"ModelParallelStrategy: sharding must be a stratagem.ShardingOptions (or None), got "
            f"{type(sharding).__name__}: {sharding!r}"
        )
    if batch_axis is None or batch_axis not in mesh.axis_names or mesh.axis_size(batch_axis) < 2:
        raise ValueError(
            f"ModelParallelStrategy: sharding= shards the model over the batch axis "
            f"{batch_axis!r}, and mesh {mesh} has no such axis with 2 or more processes: use a 2-D "
            "mesh, e.g. DeviceMesh((2, 2), ('data', 'model')), or leave sharding=None"
        )
    if sharding.gradient_op not in ("sum", "mean"):
        raise ValueError(
            f"ModelParallelStrategy: sharding=ShardingOptions(gradient_op={sharding.gradient_op!r}): "
            "gradient_op must be 'sum' or 'mean'"
        )
    size, n = sharding.shard_size, mesh.axis_size(batch_axis)
    if size is not None and (not isinstance(size, int) or size < 1 or n % size):
        raise ValueError(
            f"ModelParallelStrategy: sharding=ShardingOptions(shard_size={size!r}) must divide the "
            f"{n} processes of the batch axis {batch_axis!r} (each group of shard_size processes "
            "holds one sharded copy, HSDP); use a divisor of it, or None to shard over the whole axis"
        )
    clash = {DATA_REPLICATE, DATA_SHARD} & set(mesh.axis_names)
    if size is not None and size != n and clash:
        raise ValueError(
            f"ModelParallelStrategy: sharding=ShardingOptions(shard_size={size}) cuts the batch axis "
            f"into {DATA_REPLICATE!r} x {DATA_SHARD!r}, names mesh {mesh} already uses for "
            f"{sorted(clash)}; name the batch axis 'data'"
        )
