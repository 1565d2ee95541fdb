"""ModelParallelStrategy: layers split over a DeviceMesh's "model" axis by a LayoutMap (Keras 3's ModelParallel).

``mesh = DeviceMesh((2,), ("model",))``, ``layout_map = LayoutMap(mesh)``,
``layout_map[r"attn\\.(q|k|v)\\.weight"] = ("model", None)``, then
``ModelParallelStrategy(mesh, layout_map)``: the model built in its scope is split as the map
says (torch's ``parallelize_module`` on DTensor). With a 2-D mesh ``("data", "model")`` the batch
is split over ``batch_axis`` too, and the model sharded over it (FSDP x TP). ``init``: as for
ShardedStrategy (``"auto"``/``"materialize"``: built on the host as on one device, then split;
``"meta"``: built on the meta device, each shard initialised by replaying ``reset_parameters()``).
"""

from __future__ import annotations

from typing import final

from stratagem.distribute.engines.build import check_init
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
    ) -> None:
        check_init(init, "ModelParallelStrategy")
        if layout_map.mesh != mesh:
            raise ValueError(f"ModelParallelStrategy: the layout map is for mesh {layout_map.mesh}, not {mesh}")
        started = start("ModelParallelStrategy", devices, timeout=timeout, mesh=mesh)
        self.cluster_spec = started.spec
        self.device = device = started.device
        comm = started.comm
        super().__init__(
            TensorParallelExtended(
                comm, device, mesh, layout_map, model_axis=model_axis, batch_axis=batch_axis, name="ModelParallelStrategy",
                init=init,
            )
        )
