"""The per-replica train, test and predict steps fit/evaluate/predict run through a strategy.

``DataParallelSteps`` serves every data-parallel strategy (default, OneDevice, Mirrored,
MultiWorkerMirrored): each replica gets its slice of the global batch, computes per-example
losses and scales them with ``compute_average_loss``, so the summed gradients equal single-device
training on the global batch with the mean loss. Metrics are updated with this replica's slice
only (no communication); fit sums them across replicas afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from stratagem.core import tree
from stratagem.core.batches import batch_size_of
from stratagem.core.sample_weights import per_example, weigh
from stratagem.distribute import current
from stratagem.distribute.determinism import op_determinism
from stratagem.distribute.loss import compute_average_loss
from stratagem.distribute.mixed_precision import Policy
from stratagem.distribute.strategy import Strategy
from stratagem.train.execution_metrics import ExecutionMetrics
from stratagem.train.losses import LossFn, check_shapes, per_example_loss
from stratagem.train.metrics import Metric, sync_metrics
from stratagem.train.outputs import call_model, examples_in, for_gather, model_loss, predictions
from stratagem.train.pieces import PieceRunner


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


#: torch loss modules whose ``reduction="mean"`` is the mean over examples of the per-example
#: losses fit would compute from ``reduction="none"`` (each example's elements averaged first):
#: a mean over all elements of same-shaped examples. Exact types only (a subclass may differ).
_MEAN_OF_EXAMPLES = (
    nn.CrossEntropyLoss, nn.NLLLoss, nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss,
    nn.BCELoss, nn.BCEWithLogitsLoss,
)  # fmt: skip


def _examples(y: Any) -> int | None:
    """The number of examples in labels ``y`` (the leading dimension of its first batched
    tensor, as ``per_example_loss`` counts them); None when it has none."""
    if type(y) is torch.Tensor:
        return int(y.shape[0]) if y.dim() else None
    for t in tree.leaves(y):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def _update(metrics: Sequence[Metric], y: Any, outputs: Any, sw: Any) -> None:
    for m in metrics:
        m.update_state(y, outputs, sample_weight=sw)


@dataclass(frozen=True)
class TrainOptions:
    """fit's per-update options: ``accumulate`` batches per optimizer update (one gradient
    all-reduce per update), gradient clipping of the reduced gradients (Keras's ``clipnorm``
    per tensor, ``clipvalue``, ``global_clipnorm``), ``class_weight`` {class id: weight},
    ``jit_compile``: the forward pass and loss compiled with ``stratagem.function`` (Keras's
    ``jit_compile=True``; the backward pass is compiled with them, collectives stay eager)."""

    accumulate: int = 1
    clipnorm: float | None = None
    clipvalue: float | None = None
    global_clipnorm: float | None = None
    class_weight: dict[int, float] | None = None
    jit_compile: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive integer, got {self.accumulate!r}")
        if self.class_weight is not None:
            bad = [k for k in self.class_weight if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0]
            if bad:
                raise TypeError(f"class_weight maps class ids (ints >= 0) to weights; got the key(s) "
                                f"{', '.join(repr(k) for k in bad)}")
        for name in ("clipnorm", "clipvalue", "global_clipnorm"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")

    @property
    def clips(self) -> bool:
        return self.clipnorm is not None or self.clipvalue is not None or self.global_clipnorm is not None

    def clip(self, params: list[torch.Tensor]) -> None:
        grads = [p for p in params if p.grad is not None]
        # torch's foreach kernels refuse a list mixing DTensors (split layers) with plain tensors
        # (replicated ones, under ModelParallelStrategy): each kind is clipped as its own list
        kinds = _by_kind(grads)
        if self.clipvalue is not None:
            for same in kinds:
                torch.nn.utils.clip_grad_value_(same, self.clipvalue)
        if self.clipnorm is not None:
            for p in grads:
                torch.nn.utils.clip_grad_norm_([p], self.clipnorm)
        if self.global_clipnorm is not None and kinds:
            if len(kinds) == 1:
                torch.nn.utils.clip_grad_norm_(grads, self.global_clipnorm)
                return
            norms = []
            for same in kinds:
                n = torch.nn.utils.get_total_norm([p.grad for p in same if p.grad is not None])
                norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
            total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
            for same in kinds:
                torch.nn.utils.clip_grads_with_norm_(same, self.global_clipnorm, total)

    def weights_for(self, y: Any, sw: Any) -> Any:
        """``sw`` times the class weight of each example's label (one-hot labels: their argmax)."""
        if self.class_weight is None:
            return sw
        labels = y.argmax(dim=-1) if y.dim() > 1 and y.shape[-1] > 1 else y.reshape(y.shape[0], -1)[:, 0]
        table = torch.ones(max(max(self.class_weight) + 1, int(labels.max()) + 1 if labels.numel() else 1), dtype=torch.float32)
        for c, weight in self.class_weight.items():
            table[int(c)] = float(weight)
        w = table.to(labels.device)[labels.long()]
        weights = per_example(sw, w.shape[0], w)
        return w if weights is None else w * weights


def _by_kind(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` in lists of one kind of gradient each (plain tensors; DTensors)."""
    from torch.distributed.tensor import DTensor

    plain = [p for p in params if not isinstance(p.grad, DTensor)]
    split = [p for p in params if isinstance(p.grad, DTensor)]
    return [k for k in (plain, split) if k]


class DataParallelSteps:
    """Steps for strategies that run the whole model on every replica."""

    def __init__(
        self,
        strategy: Strategy,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: LossFn | None,
        policy: Policy | None = None,
        options: TrainOptions | None = None,
    ) -> None:
        self.strategy = strategy
        self.model = model
        self.module = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.is_chief = bool(strategy.extended.should_log)
        self.policy = policy or Policy()
        self.options = options or TrainOptions()
        self.device = strategy.extended.device
        self.scaler = self.policy.loss_scaler(self.device) if optimizer is not None else None
        #: called after every optimizer update (fit's ``lr_scheduler_interval="step"``)
        self.after_update: Callable[[], Any] | None = None
        if optimizer is not None:  # an optimizer made in a sharding scope: onto the shards now,
            strategy.extended.prepare_optimizer(optimizer)  # so clipping sees what it steps
            if not any(p.requires_grad for p in model.parameters()):
                import warnings

                warnings.warn("The model does not have any trainable weights.", stacklevel=4)
        #: the deterministic mode's pieces (stratagem.experimental.enable_op_determinism)
        self.pieces: PieceRunner | None = None
        mode = op_determinism()
        failure = getattr(strategy.extended, "failure", None)
        #: FailureOptions(on_failure="continue"): every replica reads the whole global batch and
        #: computes its range of the pieces, so the survivors of a lost replica take its share
        self.continuing = bool(failure is not None and failure.continues and optimizer is not None)
        #: called once an update is committed (its gradient whole everywhere, metrics summed)
        self.on_commit: Callable[[], None] | None = None
        #: numbers summed with the commit's metric totals (the loop's step sync: stop, rejoin),
        #: and their sums
        self.commit_extra: Callable[[], list[float]] | None = None
        self.committed_extra: list[float] = []
        if optimizer is not None and (mode is not None or self.continuing):
            if self.options.accumulate != 1:
                what = "enable_op_determinism" if mode is not None else "FailureOptions(on_failure='continue')"
                raise ValueError(
                    f"gradient_accumulation_steps is not supported with {what} yet; "
                    "leave it at 1, or make the global batch larger"
                )
            params = [q for g in optimizer.param_groups for q in g["params"]]
            self.pieces = PieceRunner(strategy, model, params, mode)
        #: the forward pass and loss, compiled once for fit's whole run when jit_compile
        self._forward: Callable[..., tuple[Any, torch.Tensor]] = self._forward_and_loss
        if self.options.jit_compile:
            from stratagem.distribute.function import function

            self._forward = function(self._forward_and_loss, jit_compile=True)

    def _forward_and_loss(self, x: Any, y: Any, fused: bool, sw: Any = None) -> tuple[Any, torch.Tensor]:
        """The model's predictions on ``x`` and its loss: the mean over the batch (``fused``: the
        loss module's own mean) or per-example losses (the model's own when ``loss_fn`` is None),
        weighted by ``sw`` (per example, or per element of a sequence's losses)."""
        loss_fn = self.loss_fn
        with self.policy.autocast(self.device):
            outputs = call_model(self.model, x)
            preds = predictions(outputs)
            if fused:
                check_shapes(loss_fn, preds, y)  # type: ignore[arg-type]
                part = loss_fn(preds, y).float()  # type: ignore[misc]
            elif loss_fn is None:  # the model's own loss (a mapping's "loss")
                part = weigh(model_loss(outputs, examples_in(x)), sw)
            else:
                part = per_example_loss(loss_fn, preds, y, sample_weight=sw).float()
        return preds, part

    def set_training(self, mode: bool) -> None:
        self.model.train(mode)

    def close(self) -> None:
        """Release what the steps hold beyond the call (nothing here)."""

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

    def train(self, group: Sequence[Any], loss_metric: Metric, metrics: Sequence[Metric]) -> float:
        """Train on the batches of ``group`` in one ``strategy.run`` (one execution): one optimizer
        update per ``options.accumulate`` batches, the loss and metrics updated at its end.
        Returns the seconds spent in the steps themselves (for ``steps_per_execution="auto"``)."""
        optimizer, loss_fn, scaler = self.optimizer, self.loss_fn, self.scaler
        assert optimizer is not None
        options, strategy = self.options, self.strategy
        params = [p for g in optimizer.param_groups for p in g["params"]]
        # the loss module's own mean is the mean over examples: one op, not three (no weights)
        fused = type(loss_fn) in _MEAN_OF_EXAMPLES and loss_fn.reduction == "mean" and options.class_weight is None  # type: ignore[attr-defined,union-attr]
        record = ExecutionMetrics(loss_metric, metrics)

        forward = self._forward

        def micro_step(x: Any, y: Any, sw: Any, total: int | None) -> None:
            n = y.shape[0] if fused and total and sw is None and type(y) is torch.Tensor and y.dim() else 0
            if n:  # sum / total == mean * (n / total)
                preds, mean = forward(x, y, True)
                loss = mean if total == n else mean * (n / (total or n))
                record.add_mean_loss(mean, n)
            else:
                if options.class_weight is not None:  # the class weights times the examples'
                    sw = options.weights_for(y, per_example(sw, _examples(y) or 0))
                preds, losses = forward(x, y, False, sw)
                loss = compute_average_loss(losses, global_batch_size=total)
                record.add_losses(losses)
            if loss.requires_grad:  # nothing trainable (model.trainable = False): Keras goes on, as here
                (loss if scaler is None else scaler.scale(loss)).backward()
            record.add(y, preds, sw)

        after_update = self.after_update
        plain_step = scaler is None and not options.clips and after_update is None

        def apply_gradients() -> None:
            if options.clips:  # the reduced gradient: identical on every replica
                if scaler is not None:
                    scaler.unscale_(optimizer)
                options.clip(params)
            if scaler is None:
                optimizer.step()
            else:  # gradients are summed across replicas first: every replica skips alike
                scaler.step(optimizer)
            if after_update is not None:
                after_update()

        in_steps = [0.0]
        pieces = self.pieces

        continuing = self.continuing

        def commit() -> None:
            """The update's gradient is whole everywhere: its metric totals summed (with what the
            loop adds to the step's sync: ``commit_extra``), then it counts."""
            record.apply()
            extra = self.commit_extra() if self.commit_extra is not None else []
            self.committed_extra = sync_metrics(strategy, [loss_metric, *metrics], extra)
            if self.on_commit is not None:
                self.on_commit()

        def execution(items: list[tuple[Any, Any, Any]]) -> None:
            if continuing:  # whole global batches: this replica's range of pieces, then the sum
                assert pieces is not None
                t0 = time.perf_counter()
                for x, y, sw in items:
                    optimizer.zero_grad(set_to_none=True)
                    pieces.step_global(x, y, sw, micro_step, commit)
                    apply_gradients()
                in_steps[0] = time.perf_counter() - t0
                record.apply()
                return
            k = options.accumulate
            # the examples of every update over all replicas (None: each step counts its own,
            # as compute_average_loss does)
            counts = self._global_counts([x if y is None else y for x, y, _ in items])
            t0 = time.perf_counter()
            if pieces is not None:  # the deterministic mode: each batch in pieces, one fixed sum
                for i, (x, y, sw) in enumerate(items):
                    optimizer.zero_grad(set_to_none=True)
                    pieces.step(x, y, sw, None if counts is None else counts[i], micro_step)
                    apply_gradients()
            elif k == 1:  # the common case, lean: one update per batch
                for i, (x, y, sw) in enumerate(items):
                    optimizer.zero_grad(set_to_none=True)
                    micro_step(x, y, sw, None if counts is None else counts[i])
                    if plain_step:
                        optimizer.step()
                    else:
                        apply_gradients()
            else:
                for start in range(0, len(items), k):
                    window = items[start : start + k]
                    total = None if counts is None else sum(counts[start : start + k])
                    optimizer.zero_grad(set_to_none=True)
                    for x, y, sw in window[:-1]:
                        with strategy.no_sync():
                            micro_step(x, y, sw, total)
                    x, y, sw = window[-1]  # the gradients are reduced in this one's backward
                    micro_step(x, y, sw, total)
                    apply_gradients()
            in_steps[0] = time.perf_counter() - t0
            record.apply()

        items = [unpack(b, need_y=loss_fn is not None) for b in group]
        # a closure, not args: the distributed iterator already placed the batches on the device
        self.strategy.run(lambda: execution(items))
        return in_steps[0]

    def _global_counts(self, ys: list[Any]) -> list[int] | None:
        """Each step's number of examples over all replicas, in one collective per execution;
        None when a step's labels have no batch dimension to count (then single steps count
        their own and accumulation is refused)."""
        local = [_examples(y) for y in ys]
        if any(c is None for c in local):
            if self.options.accumulate > 1:
                for y in ys:
                    batch_size_of(y, "y")  # the clear error
            return None
        if self.strategy.num_replicas_in_sync == 1:
            return local  # type: ignore[return-value]
        ctx = current.get_replica_context()
        assert ctx is not None
        return [int(c) for c in ctx.all_reduce("sum", torch.tensor(local, dtype=torch.int64)).tolist()]

    def test(self, batch: Any, loss_metric: Metric, metrics: Sequence[Metric]) -> None:
        model, loss_fn = self.model, self.loss_fn
        policy, device = self.policy, self.device

        def test_step(x: Any, y: Any, sw: Any) -> None:
            with torch.no_grad(), policy.autocast(device):
                outputs = call_model(model, x)
                preds = predictions(outputs)
                if loss_fn is None:
                    losses = model_loss(outputs, examples_in(x))
                else:
                    losses = per_example_loss(loss_fn, preds, y, sample_weight=sw).float()
                if loss_fn is None:
                    losses = weigh(losses, sw)
                loss_metric.update_state(losses)
                _update(metrics, y, preds, sw)

        x, y, sw = unpack(batch, need_y=loss_fn is not None)
        self.strategy.run(test_step, args=(x, y, sw))

    def predict(self, batch: Any) -> Any:
        model = self.model

        def predict_step(x: Any) -> Any:
            with torch.no_grad():
                return for_gather(call_model(model, x))

        x, _, _ = unpack(batch, need_y=False)
        outputs = self.strategy.run(predict_step, args=(x,))
        return self.strategy.gather(outputs, axis=0)
