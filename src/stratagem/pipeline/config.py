"""PipelineConfig: the settings of a pipeline (stages, micro-batches, schedule, re-materialization,
balance, data parallelism), validated when the strategy is built, with errors that say what was
received; and the mesh of stages and data-parallel copies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stratagem.core.mesh import DATA, PIPELINE, DeviceMesh
from stratagem.pipeline.errors import PipelineConfigError
from stratagem.pipeline.rematerialize import MODES
from stratagem.pipeline.schedule import (
    INTERLEAVED,
    MAY_INTERLEAVE,
    SCHEDULES,
    Schedule,
    interleaved_rounds,
    make_schedule,
    schedule_key,
)

BALANCE_METHODS = ("params", "time")


@dataclass(frozen=True)
class PipelineConfig:
    """``num_stages`` x ``data_parallel`` processes; rank ``r`` runs stage ``r % num_stages`` of
    data-parallel copy ``r // num_stages``. With ``virtual_stages`` v > 1 (interleaved schedules)
    the model is cut into ``num_stages x v`` chunks and stage ``s`` holds chunks ``s, s + K, ...``;
    ``balance`` then counts layers per chunk."""

    num_stages: int
    num_microbatches: int
    schedule: str = "gpipe"
    rematerialize: str = "auto"
    balance: tuple[int, ...] | str = "params"
    data_parallel: int = 1
    virtual_stages: int = 1
    tensor_parallel: int = 1  # each stage's layers split over this many processes (a LayoutMap's axis)
    tensor_axis: str = "model"  # that axis's name (the LayoutMap's, Keras 3's "model")

    @property
    def num_chunks(self) -> int:
        """The pieces the model is cut into: ``num_stages x virtual_stages``."""
        return self.num_stages * self.virtual_stages

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        """The chunks ``stage`` holds, in model order (looping placement)."""
        return tuple(stage + j * self.num_stages for j in range(self.virtual_stages))

    @classmethod
    def build(
        cls,
        num_stages: object,
        num_microbatches: object,
        *,
        schedule: object = "gpipe",
        rematerialize: object = "auto",
        balance: object = None,
        data_parallel: object = 1,
        virtual_stages: object = None,
        tensor_parallel: int = 1,
        tensor_axis: str = "model",
    ) -> PipelineConfig:
        for name, value in (
            ("num_stages", num_stages),
            ("num_microbatches", num_microbatches),
            ("data_parallel", data_parallel),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PipelineConfigError(f"{name} must be an integer >= 1, got {value!r}")
        assert isinstance(num_stages, int) and isinstance(num_microbatches, int)
        assert isinstance(data_parallel, int)
        key = schedule_key(schedule)
        if key is None:
            raise PipelineConfigError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if virtual_stages is None:
            virtual_stages = 2 if key in INTERLEAVED else 1
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise PipelineConfigError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")
        if virtual_stages > 1 and key not in MAY_INTERLEAVE:
            raise PipelineConfigError(
                f"virtual_stages={virtual_stages} needs an interleaved schedule, got schedule={key!r} "
                f"(one chunk per stage); use schedule='interleaved_1f1b' or 'zero_bubble', or "
                "virtual_stages=1"
            )
        if key in INTERLEAVED or virtual_stages > 1:
            if num_stages < 2:
                raise PipelineConfigError(
                    f"schedule={key!r} interleaves chunks across stages and needs num_stages >= 2, got "
                    f"num_stages={num_stages}; use schedule='gpipe' on one stage"
                )
            try:
                interleaved_rounds(num_stages, num_microbatches, key)
            except ValueError as e:
                raise PipelineConfigError(str(e)) from None
        chunks = num_stages * virtual_stages
        if rematerialize not in MODES:
            raise PipelineConfigError(f"rematerialize must be one of {list(MODES)}, got {rematerialize!r}")
        bal: tuple[int, ...] | str
        if balance is None:
            bal = "params"
        elif isinstance(balance, str):
            if balance not in BALANCE_METHODS:
                raise PipelineConfigError(
                    f"balance must be a list of layer counts or one of {list(BALANCE_METHODS)}, "
                    f"got {balance!r}"
                )
            bal = balance
        elif isinstance(balance, Sequence):
            counts = list(balance)
            if len(counts) != chunks or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts
            ):
                per = (
                    f"stage, num_stages={num_stages}" if virtual_stages == 1 else
                    f"chunk, num_stages={num_stages} x virtual_stages={virtual_stages}"
                )  # fmt: skip
                raise PipelineConfigError(
                    f"balance={counts} must hold {chunks} positive layer counts (one per {per})"
                )
            bal = tuple(counts)
        else:
            raise PipelineConfigError(
                f"balance must be a list of layer counts, 'params' or 'time', got {balance!r}"
            )
        return cls(
            num_stages, num_microbatches, key, str(rematerialize), bal, data_parallel, virtual_stages,
            tensor_parallel, tensor_axis,
        )  # fmt: skip

    @property
    def mesh(self) -> DeviceMesh:
        """The processes: ``data_parallel`` copies x ``num_stages`` stages (the stage axis
        innermost, so a copy's stages are consecutive ranks); with tensor parallelism, x
        ``tensor_parallel`` (innermost: a stage's tensor-parallel processes are consecutive
        ranks, as torchtitan lays out ``pp x dp x tp``)."""
        if self.tensor_parallel > 1:
            return DeviceMesh.of((DATA, self.data_parallel), (PIPELINE, self.num_stages), (self.tensor_axis, self.tensor_parallel))
        return DeviceMesh.of((DATA, self.data_parallel), (PIPELINE, self.num_stages))

    @property
    def world_size(self) -> int:
        return self.mesh.size

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise PipelineConfigError(
                f"this job has {world_size} processes but PipelineStrategy(num_stages="
                f"{self.num_stages}, data_parallel={self.data_parallel}"
                + (f", a layout map over {self.tensor_parallel} processes" if self.tensor_parallel > 1 else "")
                + f") needs {self.num_stages} x {self.data_parallel}"
                + (f" x {self.tensor_parallel}" if self.tensor_parallel > 1 else "")
                + f" = {self.world_size}; start "
                f"{self.world_size} processes (`stratagem run -n {self.world_size} ...`) or "
                "change num_stages/data_parallel"
            )

    def stage_of(self, rank: int) -> int:
        return self.mesh.coordinates(rank)[PIPELINE]

    def copy_of(self, rank: int) -> int:
        return self.mesh.coordinates(rank)[DATA]

    def pipeline_groups(self) -> list[list[int]]:
        """Ranks of each data-parallel copy's pipeline, stage order."""
        return self.mesh.groups(PIPELINE)

    def replica_groups(self) -> list[list[int]]:
        """Ranks holding the same stage (and tensor-parallel part) in every copy (their
        gradients are summed)."""
        return self.mesh.groups(DATA)

    def make_schedule(self) -> Schedule:
        return make_schedule(self.schedule, self.num_stages, self.num_microbatches, self.virtual_stages)
