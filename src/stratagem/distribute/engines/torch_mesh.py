"""torch's DeviceMesh for a stratagem mesh (``core/mesh.py``), made in one place for every engine."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from stratagem.comm import Communicator
from stratagem.comm.communicator import before_world_group, owned_mesh
from stratagem.core.mesh import DeviceMesh


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
