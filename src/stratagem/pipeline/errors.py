"""The errors a pipeline raises: bad configuration, a stage that failed, a shape two stages disagree on."""

from __future__ import annotations


class PipelineConfigError(ValueError):
    """A pipeline configuration that cannot work (raised when the strategy or pipeline is built)."""


class PipelineError(RuntimeError):
    """A stage of the pipeline failed; raised on every process of the pipeline.

    ``stage`` is the stage where the failure happened (``None`` if unknown). ``follows_rank``:
    on a process that did not fail but learned of another's failure, that process's rank in
    the job (the process then says so in one line, and its launcher blames the other).
    """

    def __init__(self, message: str, *, stage: int | None = None, follows_rank: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.follows_rank = follows_rank


class StageShapeError(PipelineError):
    """A stage emitted an activation the next stage does not accept (names both stages)."""
