"""How fit, evaluate and predict run steps: one runner per kind of execution (``Execution``).

``runner_for(strategy)`` is the one place that reads ``strategy.extended.execution``; what each
kind refuses, the steps it makes and the loop fit runs live in its runner:

- ``ReplicaRunner`` (REPLICAS, GLOBAL): ``DataParallelSteps``, fit's synchronous ``_Loop``;
- ``PipelineRunner`` (PIPELINE): ``PipelineSteps`` and its limits (precision, accumulation,
  class_weight, jit_compile, ``loss_fn=None``, weighted_metrics), the same loop;
- ``CoordinatedRunner`` (COORDINATED, ParameterServerStrategy): the options it cannot honour,
  and its own loop (``coordinated_fit``: steps scheduled onto workers).

The pipeline and parameter-server modules are imported when their runner first needs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stratagem.distribute.mixed_precision import Policy
from stratagem.distribute.strategy import Execution, Strategy
from stratagem.train.callback import Callback, Logs
from stratagem.train.failover import FitFailover
from stratagem.train.history import History
from stratagem.train.inputs import GlobalBatches
from stratagem.train.loop import _Loop, _run_test
from stratagem.train.losses import LossFn
from stratagem.train.metrics import Metric
from stratagem.train.overrides import KerasSteps, overridden, overrides_any
from stratagem.train.steps import DataParallelSteps, TrainOptions

if TYPE_CHECKING:
    from stratagem.pipeline.pipe import Pipe

__all__ = ["CoordinatedRunner", "FitRun", "PipelineRunner", "ReplicaRunner", "StepsRunner", "runner_for"]


@dataclasses.dataclass
class FitRun:
    """One fit call's arguments, checked and resolved (the loss, the precision policy, the
    per-update options, the metrics tracked and the History's params)."""

    model: nn.Module | Pipe
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn | None
    data: Iterable[Any]
    policy: Policy
    options: TrainOptions
    epochs: int
    initial_epoch: int
    steps_per_epoch: int | None
    validation_data: Iterable[Any] | None
    validation_steps: int | None
    tracked: list[Metric]
    val_tracked: list[Metric]
    params: dict[str, Any]
    callbacks: Sequence[Callback]
    verbose: int | str
    steps_per_execution: int | str
    lr_scheduler: Any
    lr_scheduler_interval: str


class StepsRunner:
    """How one kind of execution runs fit, evaluate and predict: what it refuses, the steps object
    it makes, and fit's loop (by default the synchronous ``_Loop``: replicas step together)."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def check_metrics(self, weighted_metrics: Any) -> None:
        """Refuse metrics this kind cannot compute (fit and evaluate)."""

    def check_fit(self, run: FitRun) -> None:
        """Refuse fit's options this kind cannot honour (before any steps are made)."""

    def steps(
        self,
        model: nn.Module | Pipe,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: LossFn | None,
        policy: Policy | None = None,
        options: TrainOptions | None = None,
    ) -> Any:
        """The steps object (train / test / predict on global batches); no optimizer for evaluate and predict."""
        raise NotImplementedError

    def fit(self, run: FitRun) -> History:
        self.check_fit(run)
        strategy = self.strategy
        steps = self.steps(run.model, run.optimizer, run.loss_fn, run.policy, run.options)
        if run.lr_scheduler is not None and run.lr_scheduler_interval == "step":
            steps.after_update = run.lr_scheduler.step
        continuing = bool(getattr(steps, "continuing", False))  # on_failure="continue"
        batches = GlobalBatches(strategy, run.data, run.steps_per_epoch, whole=continuing, optimizer=run.optimizer)
        loop = _Loop(strategy, steps, run.optimizer, batches, run.tracked, run.val_tracked,
                     {**run.params, "steps": batches.steps()}, run.callbacks, run.verbose,
                     1 if continuing else run.steps_per_execution, run.options.accumulate)  # fmt: skip
        if continuing:  # one update per execution: each committed alone
            loop.continue_on_failure(FitFailover(strategy, steps, run.optimizer, run.lr_scheduler))
        loop.validation = (run.validation_data, run.validation_steps) if run.validation_data is not None else None
        loop.epoch_scheduler = run.lr_scheduler if run.lr_scheduler_interval == "epoch" else None
        try:
            return loop.run(run.initial_epoch, run.epochs)
        finally:
            steps.close()


class ReplicaRunner(StepsRunner):
    """Each replica its share of the global batch, all in step, or one global program (SPMD)."""

    def steps(
        self,
        model: nn.Module | Pipe,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: LossFn | None,
        policy: Policy | None = None,
        options: TrainOptions | None = None,
    ) -> Any:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        cls = KerasSteps if overrides_any(model) else DataParallelSteps  # the model's own steps, if any
        return cls(self.strategy, model, optimizer, loss_fn, policy or Policy.of(None), options or TrainOptions())


class PipelineRunner(StepsRunner):
    """PipelineStrategy: the model runs as stages over micro-batches (``PipelineSteps``)."""

    def check_metrics(self, weighted_metrics: Any) -> None:
        if weighted_metrics:
            raise ValueError(
                "weighted_metrics is not supported under PipelineStrategy yet (its steps pass no sample weights "
                "to metrics); give the metrics in metrics= (unweighted, as Keras's)"
            )

    def check_fit(self, run: FitRun) -> None:
        policy, options = run.policy, run.options
        if policy.name != "32":
            raise ValueError(f"precision={policy.name!r} is not supported under PipelineStrategy yet; use precision='32'")
        if options.accumulate != 1 or options.class_weight is not None or options.jit_compile:
            raise ValueError(
                "gradient_accumulation_steps, class_weight and jit_compile are not supported under "
                "PipelineStrategy yet (its micro-batches already accumulate: raise num_microbatches "
                "and the batch size instead); leave them unset"
            )
        from stratagem.pipeline.pipe import Pipe

        if run.loss_fn is None and not isinstance(run.model, Pipe):
            raise ValueError(
                "loss_fn=None (the model's own loss) is not supported under PipelineStrategy: the "
                "last stage computes the loss from the model's output; pass a loss_fn"
            )

    def steps(
        self,
        model: nn.Module | Pipe,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: LossFn | None,
        policy: Policy | None = None,
        options: TrainOptions | None = None,
    ) -> Any:
        from stratagem.train.pipeline_steps import PipelineSteps

        _refuse_overrides(model, "PipelineStrategy", "its stages run the model's forward over micro-batches")
        return PipelineSteps(self.strategy, model, optimizer, loss_fn, options or TrainOptions())


class CoordinatedRunner(ReplicaRunner):
    """ParameterServerStrategy: each step a function the coordinator schedules onto the next free
    worker, fit's epochs in ``coordinated_fit``; evaluate, predict and validation run the
    data-parallel steps on the chief."""

    def check_fit(self, run: FitRun) -> None:
        from stratagem.train import coordinated_fit

        if overridden(run.model, "train_step"):
            _refuse_overrides(run.model, "ParameterServerStrategy", "its workers run fit's own step functions")
        options = run.options
        coordinated_fit.unsupported({
            "precision": run.policy.name != "32", "gradient_accumulation_steps": options.accumulate != 1,
            "clipnorm": options.clipnorm, "clipvalue": options.clipvalue, "global_clipnorm": options.global_clipnorm,
            "class_weight": options.class_weight, "lr_scheduler": run.lr_scheduler,
        })  # fmt: skip

    def fit(self, run: FitRun) -> History:
        from stratagem.train import coordinated_fit

        self.check_fit(run)
        strategy = self.strategy

        def validate() -> Logs:
            steps = self.steps(run.model, None, run.loss_fn)
            return _run_test(strategy, steps, run.validation_data, run.val_tracked, None, run.validation_steps)  # type: ignore[arg-type]

        assert isinstance(run.model, nn.Module)  # a Pipe exists only under PipelineStrategy
        return coordinated_fit.fit_coordinated(
            strategy, run.model, run.optimizer, run.loss_fn, run.data, epochs=run.epochs,
            steps_per_epoch=run.steps_per_epoch, tracked=run.tracked, callbacks=run.callbacks, verbose=run.verbose,
            initial_epoch=run.initial_epoch, validate=validate if run.validation_data is not None else None,
            params=run.params,
        )  # fmt: skip


def _refuse_overrides(model: Any, strategy: str, why: str) -> None:
    if overrides_any(model):
        steps = [n for n in ("train_step", "test_step", "predict_step") if overridden(model, n)]
        raise ValueError(
            f"{type(model).__name__} overrides {', '.join(steps)}, which fit, evaluate and predict do not run under "
            f"{strategy} ({why}); use the built-in steps (compile(loss=..., metrics=...)) there, or a data-parallel "
            "strategy (MirroredStrategy, MultiWorkerMirroredStrategy)"
        )


_RUNNERS: dict[Execution, type[StepsRunner]] = {
    Execution.REPLICAS: ReplicaRunner,
    Execution.GLOBAL: ReplicaRunner,
    Execution.PIPELINE: PipelineRunner,
    Execution.COORDINATED: CoordinatedRunner,
}


def runner_for(strategy: Strategy) -> StepsRunner:
    """The runner for how ``strategy.run`` executes a step."""
    return _RUNNERS.get(strategy.extended.execution, ReplicaRunner)(strategy)
