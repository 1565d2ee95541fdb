"""The job's one mesh: stratagem's rank layout (``core/mesh.py``), torch's ``DeviceMesh`` with the
same shape and axis names (made once, when an engine first needs it), and every sub-communicator
a strategy uses, taken from torch's mesh's groups."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from stratagem.comm import Communicator, LocalCommunicator
from stratagem.comm.communicator import ProcessGroupCommunicator, before_world_group, owned_mesh
from stratagem.core.mesh import DeviceMesh


class JobMesh:
    """One per strategy: its processes as ``layout`` (a ``core.mesh.DeviceMesh``) over the job's
    communicator ``world``. ``comm(*axes)`` is the communicator of this process's neighbours
    along ``axes`` (a pipeline, a stage's copies, a tensor-parallel group): the group torch's mesh
    made for that axis (``init_device_mesh`` makes one per axis; several axes are flattened into
    one group), so FSDP, tensor parallelism and stratagem's own collectives talk over the same
    groups. An axis of one process is a ``LocalCommunicator`` and the whole mesh is ``world``
    itself; neither makes a group. (The strategy has checked the layout against the job's size,
    in its own words; torch's mesh checks again when it is made.)"""

    def __init__(self, layout: DeviceMesh, world: Communicator, device: torch.device) -> None:
        self.layout = layout
        self.world = world
        self.device = device
        self._torch: Any = None
        self._comms: dict[tuple[str, ...], Communicator] = {}

    @property
    def torch(self) -> Any:
        """torch's ``DeviceMesh`` with the layout's shape and axis names (made on first use: a
        collective over the whole job, as every process asks at the same point)."""
        if self._torch is None:
            self._torch = build_torch_mesh(self.layout, self.world, self.device)
        return self._torch

    def comm(self, *axes: str) -> Communicator:
        """The communicator of this process's group along ``axes`` (outermost first)."""
        key = tuple(a for a in self.layout.axis_names if a in axes)
        unknown = sorted(set(axes) - set(self.layout.axis_names))
        if unknown:
            raise ValueError(f"the mesh {self.layout} has no axis {', '.join(map(repr, unknown))}")
        if key not in self._comms:
            size = math.prod(self.layout.axis_size(a) for a in key)
            if size == 1:
                self._comms[key] = LocalCommunicator(self.device)
            elif size == self.world.world_size:
                self._comms[key] = self.world
            else:
                sub = self.torch[key]
                group = (sub._flatten() if len(key) > 1 else sub).get_group()
                self._comms[key] = ProcessGroupCommunicator(
                    group, self.device, ranks=dist.get_process_group_ranks(group), probe=getattr(self.world, "probe", None)
                )
        return self._comms[key]


def build_torch_mesh(mesh: DeviceMesh, comm: Communicator, device: torch.device) -> Any:
    """torch's ``DeviceMesh`` with ``mesh``'s shape and axis names over the job's processes (the
    same row-major layout). A 1-D mesh is the job's own process group (``DeviceMesh.from_group``;
    a 1-process group is made when the job is one process: ``fully_shard`` still needs one);
    more axes are ``init_device_mesh``'s, which makes a group per axis. The mesh lets go of its
    groups at exit (``owned_mesh``)."""
    mesh.check_world(comm.world_size, "build_torch_mesh")
    if len(mesh.shape) == 1:
        from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

        group = getattr(comm, "group", None)
        if group is None:
            if not dist.is_initialized():
                before_world_group()
                dist.init_process_group(
                    "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
                )
            group = dist.group.WORLD
        return owned_mesh(TorchDeviceMesh.from_group(group, device.type, mesh_dim_names=mesh.axis_names))  # type: ignore[arg-type]
    from torch.distributed.device_mesh import init_device_mesh

    return owned_mesh(init_device_mesh(device.type, mesh.shape, mesh_dim_names=mesh.axis_names))
