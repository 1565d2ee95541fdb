"""fit's runners (issue 32): one per kind of execution, each with its own refusals."""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

import stratagem.train.fit  # noqa: F401  (the module, not the function the package exports)
from stratagem.distribute.mixed_precision import Policy
from stratagem.distribute.strategy import Execution
from stratagem.train.runners import (
    CoordinatedRunner,
    FitRun,
    PipelineRunner,
    ReplicaRunner,
    runner_for,
)
from stratagem.train.steps import TrainOptions


def _strategy(execution: Any) -> Any:
    return types.SimpleNamespace(extended=types.SimpleNamespace(execution=execution))


def _run(**given: Any) -> FitRun:
    model = nn.Linear(2, 1)
    args: dict[str, Any] = dict(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.MSELoss(), data=[],
        policy=Policy.of(None), options=TrainOptions(), epochs=1, initial_epoch=0, steps_per_epoch=None,
        validation_data=None, validation_steps=None, tracked=[], val_tracked=[], params={}, callbacks=(),
        verbose=0, steps_per_execution="auto", lr_scheduler=None, lr_scheduler_interval="epoch",
    )  # fmt: skip
    args.update(given)
    return FitRun(**args)


@pytest.mark.parametrize(
    "execution, kind",
    [(Execution.REPLICAS, ReplicaRunner), (Execution.GLOBAL, ReplicaRunner),
     (Execution.PIPELINE, PipelineRunner), (Execution.COORDINATED, CoordinatedRunner)],
)  # fmt: skip
def test_each_kind_of_execution_has_its_runner(execution, kind):
    runner = runner_for(_strategy(execution))
    assert type(runner) is kind


def test_fit_reads_the_execution_only_through_its_runner():
    source = inspect.getsource(sys.modules["stratagem.train.fit"])
    assert "extended.execution" not in source and "Execution" not in source


def test_the_pipeline_runner_refuses_what_pipelines_cannot_do_yet():
    runner = runner_for(_strategy(Execution.PIPELINE))
    with pytest.raises(ValueError, match=r"^weighted_metrics is not supported under PipelineStrategy yet"):
        runner.check_metrics(["mae"])
    runner.check_metrics(())
    with pytest.raises(ValueError, match=r"^precision='bf16' is not supported under PipelineStrategy yet; use precision='32'$"):
        runner.check_fit(_run(policy=Policy.of("bf16")))
    for options in (TrainOptions(accumulate=2), TrainOptions(class_weight={0: 1.0}), TrainOptions(jit_compile=True)):
        with pytest.raises(ValueError, match=r"^gradient_accumulation_steps, class_weight and jit_compile are not supported"):
            runner.check_fit(_run(options=options))
    with pytest.raises(ValueError, match=r"^loss_fn=None \(the model's own loss\) is not supported under PipelineStrategy"):
        runner.check_fit(_run(loss_fn=None))
    runner.check_fit(_run())


def test_the_coordinated_runner_names_every_option_a_worker_cannot_honour():
    runner = runner_for(_strategy(Execution.COORDINATED))
    runner.check_metrics(["mae"])  # weighted or not, the chief adds each step's totals
    run = _run(policy=Policy.of("bf16"), options=TrainOptions(2, 1.0, 0.5, 2.0, {0: 1.0}), lr_scheduler=object())
    with pytest.raises(ValueError) as e:
        runner.check_fit(run)
    assert str(e.value) == (
        "fit under ParameterServerStrategy does not support precision, gradient_accumulation_steps, clipnorm, "
        "clipvalue, global_clipnorm, class_weight, lr_scheduler yet: each worker steps on its own; leave them unset"
    )
    runner.check_fit(_run())


def test_the_replica_runner_needs_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module; got object"):
        runner_for(_strategy(Execution.REPLICAS)).steps(object(), None, None)  # type: ignore[arg-type]
