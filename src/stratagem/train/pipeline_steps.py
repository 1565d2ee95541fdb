"""Steps for the pipeline strategy (GPipe): the model runs as stages, one pipe per model."""

from __future__ import annotations

from typing import Any

from stratagem.distribute.strategy import Strategy


def is_pipeline(strategy: Strategy) -> bool:
    """Whether ``strategy`` is a PipelineStrategy (False while that module is not available)."""
    try:
        from stratagem.distribute.pipeline_strategy import PipelineStrategy
    except ImportError:
        return False
    return isinstance(strategy, PipelineStrategy)


def pipeline_steps(strategy: Strategy, model: Any, optimizer: Any, loss_fn: Any) -> Any:
    raise NotImplementedError("PipelineStrategy support in fit is not written yet")
