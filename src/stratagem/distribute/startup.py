"""The one start-up path of a strategy: find or start the job's processes, choose this one's device, join."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from stratagem.cluster import ClusterSpec, ensure_replicas
from stratagem.comm import Communicator
from stratagem.comm.failure import FailureOptions
from stratagem.comm.mesh import JobMesh
from stratagem.core.mesh import DATA, DeviceMesh
from stratagem.distribute.devices import plan_devices
from stratagem.distribute.join import join


class Started:
    """What a strategy starts from: this process's place in the job, its device, the devices
    of this machine's processes, the job's communicator, and (``mesh()``) the job's one mesh."""

    def __init__(
        self, spec: ClusterSpec, device: torch.device, devices: tuple[str, ...], comm: Communicator,
        layout: DeviceMesh | None = None,
    ) -> None:  # fmt: skip
        self.spec = spec
        self.device = device
        self.devices = devices
        self.comm = comm
        self._layout = layout
        self._mesh: JobMesh | None = None

    def mesh(self, layout: DeviceMesh | None = None) -> JobMesh:
        """The job's one mesh (made on the first call): ``layout`` (a strategy whose layout
        depends on the job's size, as HSDP's, gives it here), else the mesh ``start`` was given,
        else one ``data`` axis over every process. Every process group the strategy needs is one
        of its axes' (``JobMesh.comm``)."""
        if self._mesh is None:
            chosen = layout or self._layout or DeviceMesh.of((DATA, self.comm.world_size))
            self._mesh = JobMesh(chosen, self.comm, self.device)
        elif layout is not None and layout != self._mesh.layout:
            raise ValueError(f"the job's mesh is {self._mesh.layout}; it cannot also be {layout}")
        return self._mesh


def start(
    what: str,
    devices: str | Sequence[str] | None,
    *,
    timeout: float,
    replicas: int | None = None,
    mesh: DeviceMesh | None = None,
    check_world: Callable[[int], None] | None = None,
    failure: FailureOptions | None = None,
) -> Started:
    """Join the job a launcher made (torchrun, ``stratagem run``), or start it: re-run this
    script as the other processes (``cluster.launch.ensure_replicas``). Its size is ``mesh``'s
    when the strategy places its processes on one (a pipeline, a tensor-parallel mesh: a
    launched job of another size is an error naming both), else ``replicas`` (None: one process
    per device ``devices`` names, or the launcher's count). ``devices`` as MirroredStrategy takes
    them (see ``distribute/devices.py``); a list names this machine's devices. ``check_world``
    says, in the strategy's own words, that a launched job has the wrong size for ``mesh``.
    ``failure``: how failures are found and what they do (``FailureOptions``)."""
    tolerate = failure is not None and failure.continues
    restarts = failure.max_restarts if failure is not None else 0
    launched = ClusterSpec.from_environ()
    cuda = torch.cuda.device_count()
    if mesh is not None and launched is not None:
        if check_world is not None:
            check_world(launched.world_size)
        else:
            mesh.check_world(launched.world_size, what)
    if mesh is None and launched is None:
        plan = plan_devices(devices, replicas, cuda, what=what)
        spec = ensure_replicas(len(plan), tolerate=tolerate, restarts=restarts)
    else:
        spec = ensure_replicas(mesh.size if mesh is not None else replicas, tolerate=tolerate, restarts=restarts)
        local = None if isinstance(devices, (list, tuple)) else spec.local_world_size
        plan = plan_devices(devices, local, cuda, what=what)
    device = torch.device(plan[spec.local_rank % len(plan)])
    return Started(spec, device, tuple(plan), join(spec, device, timeout=timeout, failure=failure), mesh)
