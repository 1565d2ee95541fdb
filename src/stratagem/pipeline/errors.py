"""The errors a pipeline raises: bad configuration, a stage that failed, a shape two stages disagree on."""

from __future__ import annotations


class PipelineConfigError(ValueError):
    """A pipeline configuration that cannot work (raised when the strategy or pipeline is built)."""


class PipelineError(RuntimeError):
    """A stage of the pipeline failed; raised on every process of the pipeline.

    ``stage`` is the stage where the failure happened (``None`` if unknown).
    """

    def __init__(self, message: str, *, stage: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage


class StageShapeError(PipelineError):
    """A stage emitted an activation the next stage does not accept (names both stages)."""
