"""Pipe: what ``strategy.pipeline(model, loss_fn)`` returns on each process: this stage's
parameters under their original names, ``train_step`` (one synchronous mini-batch) and
``predict``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.comm import Communicator
from stratagem.comm.reducer import GradientReducer
from stratagem.core import tree
from stratagem.core.batches import place
from stratagem.core.whole import whole_tensor
from stratagem.pipeline.microbatch import batch_size, loss_scales, scatter, split_sizes
from stratagem.pipeline.p2p import Channel
from stratagem.pipeline.partition import Partition
from stratagem.pipeline.rematerialize import AutoRematerialize, rematerialize_stop
from stratagem.pipeline.runtime import run_inference, run_plan
from stratagem.pipeline.schedule import Schedule
from stratagem.pipeline.stage import Stage
from stratagem.pipeline.ties import TiedGradients


class Pipe:
    """This process's stage of a pipelined ``nn.Sequential``.

    ``named_parameters()`` yields only this stage's parameters, named as in the original model
    (``"2.weight"``); give them to the optimizer. ``train_step(x, y)`` runs the schedule on one
    mini-batch; the gradients it leaves equal those of ``loss_fn(model(x), y)`` on the whole
    mini-batch (summed over data-parallel copies), and it returns this copy's share of the loss
    on every stage (``strategy.reduce("sum", loss)`` is the global loss).
    """

    def __init__(
        self,
        model: nn.Module,
        stage: Stage | Sequence[Stage],
        channel: Channel | None,
        schedule: Schedule,
        partition: Partition,
        *,
        rematerialize: str,
        loss_reduction: str,
        replicas: Communicator,
        tied: TiedGradients | None = None,
        sharded: bool = False,
        pipeline: Communicator | None = None,
    ) -> None:
        self.model = model
        #: this process's chunks of the model, in model order (one but under interleaved plans)
        self.stages = [stage] if isinstance(stage, Stage) else list(stage)
        self.stage = self.stages[0]
        self.module = nn.ModuleList([st.module for st in self.stages])
        self.channel = channel
        self.schedule = schedule
        self.partition = partition
        self.rematerialize = rematerialize
        #: rematerialize="auto": this rank's choice of what to recompute, made after a first step
        self._auto = (
            AutoRematerialize(self.module, self.stage.device, stage=self.stage.index)
            if rematerialize == "auto" else None
        )  # fmt: skip
        self.loss_reduction = loss_reduction
        self.replicas = replicas
        self.tied = tied  # weights tied to another stage's: gradients summed after each backward
        self.sharded = sharded  # the layers are sharded over the copies (FSDP reduces the gradients)
        self.pipeline = pipeline  # this copy's stages (one process each): a norm over the whole model
        self.num_microbatches = schedule.num_microbatches
        owned = {id(p) for p in self.module.parameters()}
        self._named = [(n, p) for n, p in model.named_parameters() if id(p) in owned]
        self.reducer: GradientReducer | None = None
        self._trainable: list[bool] = []
        self._build_reducer()

    def _build_reducer(self) -> None:
        """Reduce this stage's trainable gradients across the pipeline replicas; rebuilt when a
        parameter's ``requires_grad`` changes (a layer unfrozen), keeping what the old one knew."""
        old, self.reducer = self.reducer, None
        if old is not None:
            old.remove()
        self._trainable = [p.requires_grad for _, p in self._named]
        trainable = [(n, p) for n, p in self._named if p.requires_grad]
        if self.replicas.world_size > 1 and trainable and not self.sharded:
            self.reducer = GradientReducer(
                self.replicas, [p for _, p in trainable], [n for n, _ in trainable], op="sum"
            )
            self.reducer.enabled = False
            if old is not None:
                self.reducer.adopt(old)

    # --- the local stage as a module ----------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._named)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self._named)

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        owned = {id(b) for b in self.module.buffers()}
        return ((n, b) for n, b in self.model.named_buffers() if id(b) in owned)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under their original names, whole (a stage sharded
        over its copies gathers them: call it on every copy)."""
        out = {n: whole_tensor(p.detach()) for n, p in self._named}
        out.update({n: whole_tensor(b.detach()) for n, b in self.named_buffers()})
        return out

    def train(self, mode: bool = True) -> Pipe:
        self.module.train(mode)
        return self

    def eval(self) -> Pipe:
        return self.train(False)

    @property
    def stage_index(self) -> int:
        return self.stage.index

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @property
    def is_first(self) -> bool:
        """Whether this process holds the model's first layer (it is given the inputs)."""
        return any(st.is_first for st in self.stages)

    @property
    def is_last(self) -> bool:
        """Whether this process holds the model's last layer (it computes the loss)."""
        return any(st.is_last for st in self.stages)

    # --- steps ------------------------------------------------------------------------------------
    def _prepare(self, x: Any) -> tuple[list[int], int]:
        leaves, _ = tree.flatten(x)
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                raise ValueError(
                    "the input is on the meta device; create data outside strategy.scope()"
                )
        n = batch_size(x)
        return split_sizes(n, self.num_microbatches), n

    def _place(self, value: Any) -> Any:
        return place(value, self.stage.device)

    def train_step(self, x: Any, y: Any) -> torch.Tensor:
        """Forward and backward of the mini-batch ``(x, y)`` through every stage (call it with the
        same batch on every process of this pipeline); returns the mini-batch loss."""
        sizes, n = self._prepare(x)
        if batch_size(y) != n:
            raise ValueError(f"x has {n} examples but y has {batch_size(y)}; they must match")
        total = n
        if self.loss_reduction == "mean" and self.replicas.world_size > 1:
            count = torch.tensor([n], dtype=torch.int64, device=self.replicas.device)
            self.replicas.all_reduce_(count, "sum")
            total = int(count.item())
        scales = loss_scales(sizes, self.loss_reduction, total)
        xs = scatter(self._place(x), sizes) if self.is_first else [None] * len(sizes)
        ys = scatter(self._place(y), sizes) if self.is_last else [None] * len(sizes)
        if (
            self.replicas.world_size > 1 and not self.sharded
            and [p.requires_grad for _, p in self._named] != self._trainable
        ):
            self._build_reducer()  # every replica of this stage runs the same program: all do
        reducer = self.reducer

        def arm(last: bool) -> None:
            if reducer is not None:
                reducer.enabled = last

        actions = self.schedule[self.stage.index]
        if self._auto is not None:
            stop = self._auto.stop(actions, sizes, len(self.stages))
            measuring: contextlib.AbstractContextManager[None] = self._auto.measuring(sizes)
        else:
            stop, measuring = rematerialize_stop(self.rematerialize, self.num_microbatches), contextlib.nullcontext()
        try:
            with measuring:
                loss = run_plan(
                    actions, self.stages, self.channel, xs, ys, scales, sizes, stop,
                    on_last_backward=arm if reducer is not None else None, plan=self.schedule,
                    before_backward=_sync_on_last if self.sharded else None,
                )  # fmt: skip
        finally:
            if reducer is not None:
                reducer.enabled = False
            if self.sharded:
                for st in self.stages:
                    _sync_on_last(st, True)  # as FSDP's default outside a step
        if self.tied is not None:
            self.tied.sum_()
        return loss.float()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole pipeline, after ``train_step`` on every
        process: the norm of every stage's gradients together (a weight tied across stages
        counted once, a sharded or split gradient whole), and every stage's gradients scaled by
        the same ``min(1, max_norm / (norm + 1e-6))``. Returns the total norm (on every process)."""
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
        skip = {id(p) for p in self.tied.duplicates()} if self.tied is not None else set()
        grads, norms = [], []
        for p in self.parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            if id(p) not in skip:
                n = torch.linalg.vector_norm(p.grad)
                norms.append((n.full_tensor() if hasattr(n, "full_tensor") else n).float().reshape(1))
        device = self.pipeline.device if self.pipeline is not None else self.stage.device
        squares = torch.cat(norms).to(device).square().sum() if norms else torch.zeros((), device=device)
        if self.pipeline is not None and self.pipeline.world_size > 1:
            self.pipeline.all_reduce_(squares, "sum")
        total = squares.sqrt()
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for g in grads:
            g.mul_(coef)
        return total

    def predict(self, x: Any) -> torch.Tensor:
        """The model's output on ``x``, run through the stages in micro-batches without autograd;
        returned on every process of the pipeline. Uses the layers' current train/eval mode."""
        sizes, _ = self._prepare(x)
        xs = scatter(self._place(x), sizes) if self.is_first else [None] * len(sizes)
        return run_inference(self.stages, self.channel, xs, sizes)

    def __call__(self, x: Any) -> torch.Tensor:
        return self.predict(x)

    def __repr__(self) -> str:
        held = ", ".join(
            f"{r.start}..{r.stop - 1}" for r in (self.partition.layers(st.index) for st in self.stages)
        )
        return (
            f"Pipe(stage {self.stage.index} of {self.num_stages}, layers {held}, "
            f"{self.schedule.name}, {self.num_microbatches} micro-batches, rematerialize={self.rematerialize!r})"
        )


def _sync_on_last(stage: Stage, last: bool) -> None:
    """A sharded stage reduce-scatters its gradients once per step, at the backward of its last
    micro-batch; the others accumulate them unsharded (FSDP's ``set_requires_gradient_sync``, as
    torch's pipelining schedules do)."""
    from torch.distributed.fsdp import FSDPModule

    for layer in stage.layers:
        if isinstance(layer, FSDPModule):
            layer.set_requires_gradient_sync(last)
            layer.set_reshard_after_backward(last)  # gathered once for the step's backwards

