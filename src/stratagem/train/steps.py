"""The per-replica train, test and predict steps fit/evaluate/predict run through a strategy.

``DataParallelSteps`` serves every data-parallel strategy (default, OneDevice, Mirrored,
MultiWorkerMirrored): each replica gets its slice of the global batch, computes per-example
losses and scales them with ``compute_average_loss``, so the summed gradients equal single-device
training on the global batch with the mean loss. Metrics are updated with this replica's slice
only (no communication); fit sums them across replicas afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from stratagem.core.batches import detach
from stratagem.distribute.loss import compute_average_loss
from stratagem.distribute.mixed_precision import Policy
from stratagem.distribute.strategy import Strategy
from stratagem.train.losses import LossFn, per_example_loss
from stratagem.train.metrics import Metric


def unpack(batch: Any, *, need_y: bool = True) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` from a batch ``(x, y)`` or ``(x, y, sample_weight)``."""
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields") and len(batch) in (2, 3):
        return batch[0], batch[1], batch[2] if len(batch) == 3 else None
    if not need_y:
        if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields") and len(batch) == 1:
            return batch[0], None, None
        return batch, None, None
    kind = type(batch).__name__
    size = f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""
    raise ValueError(
        f"each batch must be a tuple (x, y) or (x, y, sample_weight); got a {kind}{size}. "
        "Map your data to that form (e.g. dataset.map(lambda e: (e['image'], e['label'])))"
    )


def _update(metrics: Sequence[Metric], y: Any, outputs: Any, sw: Any) -> None:
    for m in metrics:
        m.update_state(y, outputs, sample_weight=sw)


class DataParallelSteps:
    """Steps for strategies that run the whole model on every replica."""

    def __init__(
        self,
        strategy: Strategy,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: LossFn | None,
        policy: Policy | None = None,
    ) -> None:
        self.strategy = strategy
        self.model = model
        self.module = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.is_chief = bool(strategy.extended.should_log)
        self.policy = policy or Policy()
        self.device = strategy.extended.device
        self.scaler = self.policy.loss_scaler(self.device) if optimizer is not None else None

    def set_training(self, mode: bool) -> None:
        self.model.train(mode)

    def loss_scale_state(self) -> dict[str, Any] | None:
        """The fp16 loss scaler's state (None without one), saved with fit's progress."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_loss_scale_state(self, state: dict[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state)

    def agree(self, flag: bool) -> bool:
        """Whether any replica raised ``flag`` (the same answer everywhere)."""
        if self.strategy.num_replicas_in_sync == 1:
            return flag
        return bool(self.strategy.reduce("sum", torch.tensor(int(flag), dtype=torch.int64)) > 0)

    def train(self, group: Sequence[Any], loss_metric: Metric, metrics: Sequence[Metric]) -> None:
        """Train on each batch of ``group`` in turn, in one ``strategy.run`` (one execution)."""
        model, optimizer, loss_fn, policy, scaler = self.model, self.optimizer, self.loss_fn, self.policy, self.scaler
        assert optimizer is not None and loss_fn is not None
        device = self.device

        def train_step(x: Any, y: Any, sw: Any) -> None:
            optimizer.zero_grad(set_to_none=True)
            with policy.autocast(device):
                outputs = model(x)
                losses = per_example_loss(loss_fn, outputs, y).float()
            if sw is not None:
                losses = losses * torch.as_tensor(sw, dtype=losses.dtype, device=losses.device)
            loss = compute_average_loss(losses)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:  # gradients are summed across replicas first: every replica skips alike
                scaler.scale(loss).backward()
                scaler.step(optimizer)
            with torch.no_grad():
                loss_metric.update_state(losses.detach())
                _update(metrics, y, detach(outputs), sw)

        def execution(steps: list[tuple[Any, Any, Any]]) -> None:
            for x, y, sw in steps:
                train_step(x, y, sw)

        self.strategy.run(execution, args=([unpack(b) for b in group],))

    def test(self, batch: Any, loss_metric: Metric, metrics: Sequence[Metric]) -> None:
        model, loss_fn = self.model, self.loss_fn
        assert loss_fn is not None

        policy, device = self.policy, self.device

        def test_step(x: Any, y: Any, sw: Any) -> None:
            with torch.no_grad(), policy.autocast(device):
                outputs = model(x)
                losses = per_example_loss(loss_fn, outputs, y).float()
                if sw is not None:
                    losses = losses * torch.as_tensor(sw, dtype=losses.dtype, device=losses.device)
                loss_metric.update_state(losses)
                _update(metrics, y, outputs, sw)

        x, y, sw = unpack(batch)
        self.strategy.run(test_step, args=(x, y, sw))

    def predict(self, batch: Any) -> Any:
        model = self.model

        def predict_step(x: Any) -> Any:
            with torch.no_grad():
                return model(x)

        x, _, _ = unpack(batch, need_y=False)
        outputs = self.strategy.run(predict_step, args=(x,))
        return self.strategy.gather(outputs, axis=0)
