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
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from stratagem.comm import LocalCommunicator
from stratagem.core import tree
from stratagem.distribute import context
from stratagem.distribute.engines.build import remember_replaced, retarget_optimizer
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.engines.device_feed import DeviceFedDataset
from stratagem.distribute.engines.input import DistributedDataset, PerReplicaDatasets
from stratagem.distribute.strategy import Execution, ReplicaContext


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
    # XLA's C++ logging warns on every compilation (GSPMD deprecation): a clean run prints only
    # what the user asked for; a user who sets the level keeps theirs
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
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
        self._pending: list[tuple[weakref.ref[nn.Module], str, str]] = []
        self._moved: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    @property
    def num_replicas_in_sync(self) -> int:
        return self.runtime.num_devices

    @property
    def device(self) -> torch.device:
        return self._xla

    @property
    def execution(self) -> Execution:
        return Execution.GLOBAL

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.materialize()
        return retarget_optimizer(optimizer)

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

    def _on_register(self, kind: str) -> Callable[[nn.Module, str, Any], None]:
        def hook(module: nn.Module, name: str, value: Any) -> None:
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                self._pending.append((weakref.ref(module), name, kind))

        return hook

    def materialize(self) -> None:
        """Move what the scope created (on the CPU, initialized by the CPU generator) to the XLA
        device: each module's parameter is replaced by one on the device (tied parameters stay
        tied), claimed like the original; an optimizer made in the scope is pointed at the new
        parameters before its first step (``engines.build.retarget_optimizer``)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        reg = self.registry
        assert reg is not None
        for mref, name, kind in pending:
            module = mref()
            if module is None:
                continue
            table = module._parameters if kind == "param" else module._buffers
            old = table.get(name)
            if old is None or old.device.type != "cpu":
                continue
            new = self._moved.get(id(old))
            if new is None or new[0]() is not old:
                with torch.no_grad():
                    moved = old.detach().to(self._xla)
                if kind == "param":
                    moved = nn.Parameter(moved, requires_grad=old.requires_grad)
                    remember_replaced(old, module, name)
                new = (weakref.ref(old), moved)
                self._moved[id(old)] = new
                reg._remember(moved, f"{type(module).__name__}.{name}", is_param=kind == "param")
            table[name] = new[1]  # type: ignore[assignment]
        self._moved = {k: v for k, v in self._moved.items() if v[0]() is not None}

    @contextlib.contextmanager
    def _scope(self) -> Iterator[None]:
        from torch.nn.modules import module as module_mod

        h1 = module_mod.register_module_parameter_registration_hook(self._on_register("param"))
        h2 = module_mod.register_module_buffer_registration_hook(self._on_register("buffer"))
        try:
            with super().scope():
                yield
        finally:
            h1.remove()
            h2.remove()
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
