"""XLAExtended: one process driving every XLA device of its host as one SPMD program.

PyTorch/XLA's SPMD mode (``torch_xla.runtime.use_spmd()``) runs one program over a mesh of
devices: parameters are replicated (mirrored) by default, each global batch is marked sharded on
its batch dimension over a 1-D ``("data",)`` mesh, and the XLA compiler splits the batch and
all-reduces the gradients. The step is traced lazily and cut (``torch_xla.sync()``) at the end of
every ``strategy.run``: XLA compiles each distinct graph once and reuses it, so steady steps do
not recompile; a partial last batch is one more shape (one more compilation), never padded, so
MEAN over its examples stays exact.

The program sees the *global* batch: the replicas in sync are the devices of the mesh, but the
values inside ``run`` are already global, so the replica context's ``all_reduce`` returns its
argument (``compute_average_loss`` then divides by the true global count) and ``reduce`` with an
axis is a reduction over the global batch.

Modules created in ``scope()`` are built on the CPU (initial weights from the CPU generator, as a
single-device CPU run draws them) and moved to the XLA device when the scope closes.

torch_xla is imported only when a runtime is started (never at stratagem's import).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from stratagem.comm import LocalCommunicator
from stratagem.core import tree
from stratagem.distribute import context
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.engines.device_feed import DeviceFedDataset
from stratagem.distribute.engines.input import DistributedDataset, PerReplicaDatasets
from stratagem.distribute.strategy import ReplicaContext


@dataclass(frozen=True)
class XLARuntime:
    """The started SPMD runtime: its devices, the data mesh, the device tensors go to."""

    num_devices: int
    device: torch.device
    mesh: Any  # torch_xla.distributed.spmd.Mesh
    pjrt_device: str


_runtime: list[XLARuntime] = []


def start_runtime(cache_dir: str | None = None) -> XLARuntime:
    """Start PyTorch/XLA in SPMD mode (once per process; later calls return the same runtime).

    SPMD fixes the device count when the runtime starts: call it before any tensor is put on an
    XLA device. ``cache_dir`` keeps compiled programs on disk between runs.
    """
    if _runtime:
        return _runtime[0]
    try:
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
    except ImportError as e:
        raise ImportError(
            "TPUStrategy needs torch_xla: pip install 'stratagem[tpu]' (torch-xla pins the torch "
            f"version it was built for; this torch is {torch.__version__}); the import failed: {e}"
        ) from e
    if not os.environ.get("PJRT_DEVICE"):
        os.environ["PJRT_DEVICE"] = "TPU"
    if cache_dir is not None:
        xr.initialize_cache(cache_dir, readonly=False)
    xr.use_spmd()
    n = int(xr.global_runtime_device_count())
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    rt = XLARuntime(n, torch.device(torch_xla.device()), mesh, os.environ["PJRT_DEVICE"])
    _runtime.append(rt)
    return rt


def sync() -> None:
    """Cut the traced graph here and run it (``torch_xla.sync``)."""
    import torch_xla

    torch_xla.sync()


def compilations() -> int:
    """How many XLA graphs this process has compiled so far (torch_xla's metrics)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


class XLAExtended(DataParallelExtended):
    """One process, every device of the runtime's data mesh, one SPMD program."""

    def __init__(self, runtime: XLARuntime, *, name: str = "TPUStrategy") -> None:
        # the registry leaves what the scope creates on the CPU (CPU-generator initial weights);
        # the scope's end moves it to the XLA device
        super().__init__(LocalCommunicator("cpu"), None, name=name)
        self.runtime = runtime
        self._xla = runtime.device

    @property
    def num_replicas_in_sync(self) -> int:
        return self.runtime.num_devices

    @property
    def device(self) -> torch.device:
        return self._xla

    # --- placement --------------------------------------------------------------------------
    def shard(self, value: Any) -> Any:
        """``value``'s tensors on the XLA device, each split on dimension 0 over the data mesh
        (scalars replicated). Tensors already on the device keep their sharding."""
        import torch_xla.distributed.spmd as xs

        mesh = self.runtime.mesh

        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.device.type == "xla":
                return t
            out = t.to(self._xla)
            if out.dim() >= 1:
                xs.mark_sharding(out, mesh, ("data",) + (None,) * (out.dim() - 1))
            return out

        return tree.map_structure(one, value)

    def materialize(self) -> None:
        """Move what the scope created (still on the CPU) to the XLA device, in place: modules
        and optimizers keep the same Parameter objects."""
        reg = self.registry
        assert reg is not None
        with torch.no_grad():
            for ref, _ in (*reg._params, *reg._buffers):
                t = ref()
                if t is not None and t.device.type == "cpu":
                    t.data = t.data.to(self._xla)

    @contextlib.contextmanager
    def _scope(self) -> Iterator[None]:
        with super().scope():
            yield
        self.materialize()

    def scope(self) -> contextlib.AbstractContextManager[None]:
        return self._scope()

    # --- run --------------------------------------------------------------------------------
    def call_for_replica(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        owner = self.owner()
        self.materialize()  # modules made in a scope still open
        args = self.shard(tuple(args))
        kwargs = self.shard(dict(kwargs))
        reg = self.registry
        assert reg is not None
        for v in (getattr(fn, "__self__", None), *args, *kwargs.values()):
            if isinstance(v, nn.Module):
                reg.check_module(v)
        ctx = ReplicaContext(owner, 0)
        with context.replica_scope(ctx), self._run_checks():
            out = fn(*args, **kwargs)
        sync()
        return out

    # --- reductions: the values of the one program are global already ------------------------
    def all_reduce(self, op: Any, value: Any) -> Any:
        return value

    def merge_values(self, value: Any) -> list[Any]:
        return [value]

    # --- input ------------------------------------------------------------------------------
    def _feed(self, inner: Any, options: Any) -> Any:
        depth = getattr(options, "experimental_per_replica_buffer_size", 1) if options is not None else 1
        return DeviceFedDataset(inner, self._xla, depth, place=self.shard)

    def distribute_dataset(self, dataset: Iterable[Any], options: Any) -> Iterable[Any]:
        """Global batches, transferred and sharded over the data mesh one batch ahead of need."""
        return self._feed(DistributedDataset(dataset, self.comm, None), options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any
    ) -> Iterable[Any]:
        return self._feed(PerReplicaDatasets(dataset_fn, self.comm, None, 1), options)
