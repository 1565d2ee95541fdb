"""ExecutionMetrics: the loss and metric updates of one fit execution, applied together.

fit runs ``steps_per_execution`` steps in one ``strategy.run``. Updating the loss and every
metric after each step costs a dozen small device ops per step, more than a tiny model's whole
step on a CPU. Instead each step's detached losses, labels, predictions and weights are kept,
and at the end of the execution (or sooner, see below) every metric is updated once with them
concatenated along the batch dimension. For an *additive* metric (``Metric.additive``: a
batch's totals are the sum of its examples' totals, true of every built-in metric) the totals
are those of one update per step; a metric that is not additive is updated after every step.

What is kept is bounded: a step whose labels, predictions or weights are not plain batched
tensors is applied at once, and what is kept is applied first whenever a step's trailing
shapes differ from it (a partial last batch) or it would exceed ``max_elements`` elements (so a
language model's logits are never hoarded across steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stratagem.core.batches import detach
from stratagem.train.metrics import Metric

#: The most label + prediction + weight elements kept across the steps of an execution.
MAX_ELEMENTS = 1 << 22


class ExecutionMetrics:
    """The loss metric and the metrics updated with one execution's steps."""

    def __init__(self, loss_metric: Metric, metrics: Sequence[Metric], max_elements: int = MAX_ELEMENTS) -> None:
        self.loss_metric = loss_metric
        self.metrics = list(metrics)
        self.max_elements = max_elements
        self._deferrable = all(m.additive for m in self.metrics)
        self._means: list[tuple[torch.Tensor, int]] = []  # (mean loss of a step, its examples)
        self._losses: list[torch.Tensor] = []  # per-example losses of a step
        self._kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._kept_key: tuple[Any, ...] | None = None
        self._step_elements = 0
        self._elements = 0

    def add_mean_loss(self, mean: torch.Tensor, count: int) -> None:
        """A step's loss given as the mean over its ``count`` examples (a scalar)."""
        self._means.append((mean.detach(), count))

    def add_losses(self, losses: torch.Tensor) -> None:
        """A step's per-example losses (shape ``[batch]``)."""
        self._losses.append(losses.detach())

    def add(self, y: Any, outputs: Any, sample_weight: Any) -> None:
        """A step's labels, predictions and (per-example) weights for the metrics."""
        if not self.metrics:
            return
        if (
            self._deferrable
            and type(y) is torch.Tensor
            and type(outputs) is torch.Tensor
            and (sample_weight is None or type(sample_weight) is torch.Tensor)
        ):
            # kept together while the shapes stay the same (a partial last batch starts anew)
            key = (y.shape, outputs.shape, None if sample_weight is None else sample_weight.shape)
            if key == self._kept_key:
                self._kept.append((y, outputs.detach(), sample_weight))
                self._elements += self._step_elements
                if self._elements > self.max_elements:
                    self._apply_metrics()
                return
            if y.dim() and outputs.dim() and (sample_weight is None or sample_weight.dim()):
                self._apply_metrics()
                self._kept_key = key
                self._step_elements = y.numel() + outputs.numel() + (0 if sample_weight is None else sample_weight.numel())
                self._kept.append((y, outputs.detach(), sample_weight))
                self._elements = self._step_elements
                return
        self._apply_metrics()  # not concatenable: what is kept, then this step
        outputs = detach(outputs)
        with torch.no_grad():
            for m in self.metrics:
                m.update_state(y, outputs, sample_weight=sample_weight)

    def apply(self) -> None:
        """Update the loss metric and the metrics with everything kept (call it before the
        execution's end is synced)."""
        with torch.no_grad():
            self._apply_losses()
            self._apply_metrics()

    def _apply_losses(self) -> None:
        if self._means:
            by_count: dict[int, list[torch.Tensor]] = {}
            for mean, count in self._means:
                by_count.setdefault(count, []).append(mean)
            for count, means in by_count.items():  # sum(mean * count) without a host-to-device copy
                total = torch.stack(means).to(torch.float64).sum() * count
                self.loss_metric.add_totals(torch.stack((total, total.new_full((), float(count * len(means))))))
            self._means = []
        if self._losses:
            self.loss_metric.update_state(torch.cat(self._losses) if len(self._losses) > 1 else self._losses[0])
            self._losses = []

    def _apply_metrics(self) -> None:
        kept, self._kept, self._kept_key, self._elements = self._kept, [], None, 0
        if not kept:
            return
        groups = kept
        if len(kept) > 1:
            try:  # one group; dtypes that differ are promoted (exactly, for the metrics' float64)
                y = torch.cat([k[0] for k in kept])
                outputs = torch.cat([k[1] for k in kept])
                sw = None if kept[0][2] is None else torch.cat([k[2] for k in kept])  # type: ignore[misc]
                groups = [(y, outputs, sw)]
            except RuntimeError:  # e.g. on different devices: one update per step
                pass
        with torch.no_grad():
            for y, outputs, sw in groups:
                for m in self.metrics:
                    m.update_state(y, outputs, sample_weight=sw)
