"""The one mesh (core/mesh.py): torch's row-major layout, groups along any axes, the layouts the
strategies' presets give, and clear errors. Pure: no process group."""

from __future__ import annotations

import itertools

import pytest

from stratagem.core.mesh import DATA, DATA_REPLICATE, DATA_SHARD, PIPELINE, DeviceMesh, MeshError
from stratagem.pipeline.config import PipelineConfig


def test_coordinates_are_torchs_row_major_layout():
    mesh = DeviceMesh((2, 3, 2), ("pipeline", "data", "tensor"))
    # torch's DeviceMesh(device_type, torch.arange(12).view(2, 3, 2)): rank r at the index of r
    for r, (p, d, t) in enumerate(itertools.product(range(2), range(3), range(2))):
        assert mesh.coordinates(r) == {"pipeline": p, "data": d, "tensor": t}
        assert mesh.rank_at(pipeline=p, data=d, tensor=t) == r


def test_groups_along_one_axis_and_several():
    mesh = DeviceMesh((2, 3), ("data", "model"))
    assert mesh.groups("data") == [[0, 3], [1, 4], [2, 5]]
    assert mesh.groups("model") == [[0, 1, 2], [3, 4, 5]]
    assert mesh.groups("data", "model") == [[0, 1, 2, 3, 4, 5]]
    assert mesh.groups("context") == [[r] for r in range(6)]  # an axis the mesh lacks: alone
    assert mesh.axis_size("model") == 3 and mesh.axis_size("context") == 1
    assert str(mesh) == "data 2 x model 3"


def test_a_pipeline_is_copies_of_consecutive_stages():
    """PipelineStrategy's documented layout: rank r runs stage r % K of copy r // K."""
    for k, d in [(1, 1), (2, 1), (3, 2), (2, 3), (4, 2)]:
        cfg = PipelineConfig.build(k, 4, data_parallel=d)
        assert cfg.mesh == DeviceMesh.of((DATA, d), (PIPELINE, k))
        assert cfg.world_size == k * d
        assert [cfg.stage_of(r) for r in range(k * d)] == [r % k for r in range(k * d)]
        assert [cfg.copy_of(r) for r in range(k * d)] == [r // k for r in range(k * d)]
        assert cfg.pipeline_groups() == [[c * k + s for s in range(k)] for c in range(d)]
        assert cfg.replica_groups() == [[c * k + s for c in range(d)] for s in range(k)]


def test_hsdp_shards_within_consecutive_ranks():
    mesh = DeviceMesh.of((DATA_REPLICATE, 2), (DATA_SHARD, 3))
    assert mesh.groups(DATA_SHARD) == [[0, 1, 2], [3, 4, 5]]  # one sharded copy each
    assert mesh.groups(DATA_REPLICATE) == [[0, 3], [1, 4], [2, 5]]  # the same shard in each copy


def test_errors_say_what_was_received_and_what_to_do():
    with pytest.raises(MeshError, match=r"shape \(2, 2\) has 2 axes but axis_names \('model',\) names 1"):
        DeviceMesh((2, 2), ("model",))
    with pytest.raises(MeshError, match="axis names must differ"):
        DeviceMesh((2, 2), ("data", "data"))
    with pytest.raises(MeshError, match="at least one process"):
        DeviceMesh((2, 0), ("data", "model"))
    mesh = DeviceMesh((2, 2), ("data", "model"))
    with pytest.raises(MeshError, match=r"the mesh data 2 x model 2 places 4 processes but this job has 3; start 4"):
        mesh.check_world(3, "ModelParallelStrategy")
    mesh.check_world(4, "ModelParallelStrategy")
    with pytest.raises(MeshError, match="no axis 'tensor'"):
        mesh.rank_at(tensor=1)
    with pytest.raises(MeshError, match="outside the mesh"):
        mesh.coordinates(4)
    assert issubclass(MeshError, ValueError)


def test_the_public_name_is_the_one_mesh():
    import stratagem as sg
    from stratagem.distribute.engines.layout import DeviceMesh as from_layouts

    assert sg.DeviceMesh is DeviceMesh is from_layouts
