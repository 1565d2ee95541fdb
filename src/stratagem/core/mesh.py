"""One mesh: a job's processes as a grid with named axes (pure data), the one rank layout.

``DeviceMesh((2, 3), ("data", "pipeline"))`` is Keras 3's ``keras.distribution.DeviceMesh`` and
the layout torch's ``DeviceMesh`` builds from the same shape and names: rank ``r`` sits at the
row-major coordinates of ``r`` (the last axis varies fastest). Every strategy describes its
processes with one: Mirrored and MultiWorker a 1-D ``("data",)`` mesh, ShardedStrategy
``("data_shard",)`` (HSDP: ``("data_replicate", "data_shard")``), PipelineStrategy ``("data",
"pipeline")`` (rank ``r`` runs stage ``r % num_stages`` of copy ``r // num_stages``), and
ModelParallelStrategy the mesh its user gives. Which ranks talk together along an axis
(``groups``), where a rank sits (``coordinates``) and whether the job has the processes the mesh
needs (``check_world``) are answered here and nowhere else. Imports nothing from the package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: the axis names stratagem's presets use (a user's mesh may name its axes as it likes)
DATA = "data"
DATA_REPLICATE = "data_replicate"
DATA_SHARD = "data_shard"
CONTEXT = "context"
TENSOR = "tensor"
PIPELINE = "pipeline"


class MeshError(ValueError):
    """A mesh that cannot describe this job (its size, an axis it lacks)."""


@dataclass(frozen=True)
class DeviceMesh:
    """Processes arranged in a grid with named axes: ``DeviceMesh((2, 2), ("data", "model"))``."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "axis_names", tuple(self.axis_names))
        if len(self.shape) != len(self.axis_names):
            raise MeshError(
                f"DeviceMesh: shape {self.shape} has {len(self.shape)} axes but axis_names "
                f"{self.axis_names} names {len(self.axis_names)}"
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise MeshError(f"DeviceMesh: axis names must differ, got {self.axis_names}")
        if any(n < 1 for n in self.shape):
            raise MeshError(f"DeviceMesh: every axis needs at least one process, got shape {self.shape}")

    @classmethod
    def of(cls, *axes: tuple[str, int]) -> DeviceMesh:
        """A mesh from ``(name, degree)`` pairs, outermost first: ``DeviceMesh.of(("data", 2), ("pipeline", 3))``."""
        return cls(tuple(n for _, n in axes), tuple(name for name, _ in axes))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        """The number of processes along ``name`` (1 for an axis the mesh does not have)."""
        return self.shape[self.axis_names.index(name)] if name in self.axis_names else 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where process ``rank`` sits on each axis (row-major, as torch's DeviceMesh)."""
        if not 0 <= rank < self.size:
            raise MeshError(f"rank {rank} is outside the mesh {self} of {self.size} processes")
        out = {}
        for name, n in reversed(list(zip(self.axis_names, self.shape))):
            out[name] = rank % n
            rank //= n
        return {name: out[name] for name in self.axis_names}

    def rank_at(self, **coordinates: int) -> int:
        """The rank at the given coordinates (an axis left out is at 0)."""
        unknown = sorted(set(coordinates) - set(self.axis_names))
        if unknown:
            raise MeshError(f"the mesh {self} has no axis {', '.join(map(repr, unknown))}")
        rank = 0
        for name, n in zip(self.axis_names, self.shape):
            c = coordinates.get(name, 0)
            if not 0 <= c < n:
                raise MeshError(f"coordinate {name}={c} is outside the mesh {self}")
            rank = rank * n + c
        return rank

    def groups(self, *axes: str) -> list[list[int]]:
        """The ranks that differ only along ``axes``, one list per group, each in rank order and
        the groups in order of their first rank (an axis the mesh does not have: groups of one)."""
        along = [a for a in axes if a in self.axis_names]
        found: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.size):
            c = self.coordinates(r)
            key = tuple(v for k, v in c.items() if k not in along)
            found.setdefault(key, []).append(r)
        return list(found.values())

    def with_hsdp(self, axis: str, shard_size: int | None) -> DeviceMesh:
        """This mesh with ``axis`` cut into ``data_replicate`` x ``data_shard`` (HSDP: groups of
        ``shard_size`` consecutive positions along ``axis`` each hold one sharded copy, replicated
        across the groups); the ranks keep their places. Unchanged when ``shard_size`` is None or
        the whole axis."""
        n = self.axis_size(axis)
        if shard_size is None or shard_size == n:
            return self
        if shard_size < 1 or n % shard_size:
            raise MeshError(f"shard_size={shard_size} must divide the {n} processes of axis {axis!r} in {self}")
        axes: list[tuple[str, int]] = []
        for name, degree in zip(self.axis_names, self.shape):
            axes += [(DATA_REPLICATE, n // shard_size), (DATA_SHARD, shard_size)] if name == axis else [(name, degree)]
        return DeviceMesh.of(*axes)

    def data_axes(self, axis: str) -> tuple[str, ...]:
        """The axes the batch is split over: ``axis``, or HSDP's two where ``with_hsdp`` cut it."""
        if axis not in self.axis_names and DATA_SHARD in self.axis_names:
            return tuple(a for a in (DATA_REPLICATE, DATA_SHARD) if a in self.axis_names)
        return (axis,) if axis in self.axis_names else ()

    def check_world(self, world_size: int, what: str) -> None:
        """A clear error unless the job has exactly the processes the mesh places."""
        if world_size != self.size:
            raise MeshError(
                f"{what}: the mesh {self} places {self.size} processes but this job has "
                f"{world_size}; start {self.size} (`stratagem run -n {self.size} ...`) or change "
                "the degrees"
            )

    def __str__(self) -> str:
        return " x ".join(f"{name} {n}" for name, n in zip(self.axis_names, self.shape))
