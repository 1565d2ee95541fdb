"""Steps for PipelineStrategy (GPipe): the model runs as stages, through one Pipe per model.

``fit(model, optimizer, loss_fn, data, strategy=pipeline_strategy)`` works with either

- the ``Pipe`` returned by ``strategy.pipeline(model, loss_fn)`` and an optimizer over
  ``pipe.parameters()`` (the pipeline module's own recipe), or
- the ``nn.Sequential`` built in ``strategy.scope()`` and an optimizer over its (meta)
  parameters, built in the scope as under any other strategy: fit then calls
  ``strategy.pipeline`` once for that model and points the optimizer at this stage's real
  parameters (it must not have stepped yet).

The train step is ``strategy.run(pipe.train_step, args=(x, y))``; the loss fit gives the pipeline
is the mean of ``per_example_loss`` (so any loss form fit accepts works and the gradients equal
single-device training on the global batch). Training metrics need the outputs, which the
pipeline does not return: with metrics, each step first runs ``pipe.predict(x)`` (one extra
forward pass, no autograd, the RNG state put back afterwards so training is unchanged). Sample
weights are not supported under a pipeline. Logs are identical on every stage; decisions
(stop_training) are agreed by every process of the job, and only stage 0 of copy 0 prints and
writes logs.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.distribute.strategy import Strategy
from stratagem.train.losses import LossFn, per_example_loss
from stratagem.train.metrics import Metric
from stratagem.train.steps import TrainOptions, unpack

_PIPES: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _mean_loss(loss_fn: LossFn) -> LossFn:
    def loss(outputs: Any, y: Any) -> torch.Tensor:
        return per_example_loss(loss_fn, outputs, y).mean()

    return loss


def _rebind(optimizer: torch.optim.Optimizer, names: dict[int, str], pipe: Any) -> None:
    """Point ``optimizer`` (built over the meta parameters) at this stage's real parameters."""
    if optimizer.state:
        raise ValueError(
            "under PipelineStrategy fit rebinds the optimizer to this stage's parameters, but this "
            "optimizer has already stepped; create a fresh optimizer in strategy.scope()"
        )
    local = dict(pipe.named_parameters())
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not the "
                    "model's; build the optimizer over model.parameters()"
                )
            if name in local:
                kept.append(local[name])
        group["params"] = kept


def _pipe_for(strategy: Strategy, model: Any, optimizer: torch.optim.Optimizer | None, loss_fn: LossFn | None) -> Any:
    from stratagem.pipeline.pipe import Pipe

    if isinstance(model, Pipe):
        return model
    pipe = _PIPES.get(model)
    if pipe is not None:
        return pipe
    params = list(model.parameters())
    if any(p.device.type == "meta" for p in params) and not all(p.device.type == "meta" for p in params):
        raise ValueError(
            "this model has already been split by strategy.pipeline(...); pass the Pipe it "
            "returned to fit/evaluate/predict instead of the model"
        )
    if loss_fn is None:
        raise ValueError(
            "predict under PipelineStrategy needs the model's pipeline: call fit or evaluate "
            "first, or pass the Pipe returned by strategy.pipeline(model, loss_fn)"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    pipe = strategy.extended.build_pipe(  # type: ignore[attr-defined]
        model, _mean_loss(loss_fn), "mean", None, False
    )
    _PIPES[model] = pipe
    if optimizer is not None:
        _rebind(optimizer, names, pipe)
    return pipe


class PipelineSteps:
    """Train, test and predict steps through this process's stage of a Pipe."""

    def __init__(self, strategy: Strategy, model: Any, optimizer: torch.optim.Optimizer | None, loss_fn: LossFn | None,
                 options: TrainOptions | None = None) -> None:  # fmt: skip
        self.strategy = strategy
        #: clipping (the pipeline's micro-batches already accumulate: no accumulation here)
        self.options = options or TrainOptions()
        #: the per-tensor clipping (``clipnorm``, ``clipvalue``) alone: each stage's own
        self._per_tensor = dataclasses.replace(self.options, global_clipnorm=None)
        #: called after every optimizer update (fit's ``lr_scheduler_interval="step"``)
        self.after_update: Callable[[], Any] | None = None
        self.pipe = _pipe_for(strategy, model, optimizer, loss_fn)
        self.module: nn.Module = self.pipe.model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self._world = strategy.extended.world
        self.is_chief = strategy.extended.should_log

    def set_training(self, mode: bool) -> None:
        self.pipe.train(mode)

    def close(self) -> None:
        """Release what the steps hold beyond the call (nothing here)."""

    def loss_scale_state(self) -> None:
        return None  # mixed precision is not supported under a pipeline yet

    def load_loss_scale_state(self, state: Any) -> None:
        return None

    def agree(self, flag: bool) -> bool:
        """Whether any process of the job (every stage of every copy) raised ``flag``."""
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self._world.device)
        if self._world.world_size > 1:
            self._world.all_reduce_(t, "max")
        return bool(t.item())

    def _global_count(self, n: int) -> int:
        if self.strategy.num_replicas_in_sync == 1:
            return n
        return int(self.strategy.reduce("sum", torch.tensor(n, dtype=torch.int64)))

    def train(self, group: Sequence[Any], loss_metric: Metric, metrics: Sequence[Metric]) -> None:
        """Train on each batch of ``group`` in turn (one execution; None: the time of the steps
        is the whole call's)."""
        for batch in group:
            self._train_one(batch, loss_metric, metrics)

    def _train_one(self, batch: Any, loss_metric: Metric, metrics: Sequence[Metric]) -> None:
        x, y, sw = unpack(batch)
        if sw is not None:
            raise ValueError("sample weights are not supported under PipelineStrategy; pass (x, y) batches")
        optimizer = self.optimizer
        assert optimizer is not None
        if metrics:
            with torch.random.fork_rng(devices=[]):
                outputs = self.pipe.predict(x)
            for m in metrics:
                m.update_state(y, outputs)
        optimizer.zero_grad(set_to_none=True)
        share = self.strategy.run(self.pipe.train_step, args=(x, y))
        self._clip()
        optimizer.step()
        if self.after_update is not None:
            self.after_update()
        n = int(y.shape[0])
        total = self._global_count(n)  # the pipeline's loss is (sum over this copy) / total
        loss_sum = float(share) * total
        loss_metric.update_state(torch.full((n,), loss_sum / n if n else 0.0, dtype=torch.float64))

    def _clip(self) -> None:
        """fit's clipping of the step's gradients: per tensor (``clipnorm``, ``clipvalue``) on
        each stage, the global norm (``global_clipnorm``) over the whole pipeline."""
        if self._per_tensor.clips:
            # (a tied weight's ends hold the same gradient: clipped alike on their stages)
            self._per_tensor.clip(list(self.pipe.parameters()))
        if self.options.global_clipnorm is not None:
            self.pipe.clip_grad_norm_(self.options.global_clipnorm)

    def test(self, batch: Any, loss_metric: Metric, metrics: Sequence[Metric]) -> None:
        assert self.loss_fn is not None
        x, y, sw = unpack(batch)
        if sw is not None:
            raise ValueError("sample weights are not supported under PipelineStrategy; pass (x, y) batches")
        outputs = self.pipe.predict(x)
        loss_metric.update_state(per_example_loss(self.loss_fn, outputs, y).detach())
        for m in metrics:
            m.update_state(y, outputs)

    def predict(self, batch: Any) -> Any:
        x, _, _ = unpack(batch, need_y=False)
        return self.strategy.gather(self.pipe.predict(x), axis=0)
