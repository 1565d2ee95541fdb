"""The local stage: its layers, the forward of a micro-batch (kept for backward or to be
recomputed) and the backward; failures name the stage, the layer and the shapes involved."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratagem.pipeline.errors import PipelineError, StageShapeError
from stratagem.pipeline.rematerialize import RNGSnapshot, frozen_buffers, replay_rng


def describe(module: nn.Module) -> str:
    """The first line of a module's repr: ``Linear(in_features=5, out_features=8, bias=True)``."""
    text = repr(module).splitlines()
    return text[0].rstrip("(") + ("(...)" if len(text) > 1 else "")


def shape_of(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{list(x.shape)} ({str(x.dtype).replace('torch.', '')})"
    return type(x).__name__


@dataclass
class _Saved:
    input: Any
    output: torch.Tensor | None  # None: recompute in backward
    rng: RNGSnapshot | None
    target: Any = None
    scale: float = 1.0


class Stage:
    """Stage ``index`` of ``num_stages``: the layers it holds and its micro-batches in flight.

    ``layer_names``/``layer_descriptions`` cover the whole model (every stage knows the
    structure), so an error can name the neighbour's layers too.
    """

    def __init__(
        self,
        index: int,
        num_stages: int,
        layers: Sequence[nn.Module],
        first_layer: int,
        layer_names: Sequence[str],
        layer_descriptions: Sequence[str],
        device: torch.device,
        loss_fn: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.index = index
        self.num_stages = num_stages
        self.layers = list(layers)
        self.module = nn.ModuleList(self.layers)
        self.first_layer = first_layer
        self.layer_names = list(layer_names)
        self.layer_descriptions = list(layer_descriptions)
        self.device = device
        self.loss_fn = loss_fn
        self._saved: dict[int, _Saved] = {}

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def _layer(self, j: int) -> str:
        g = self.first_layer + j
        return f"layer {self.layer_names[g]!r} ({self.layer_descriptions[g]})"

    # --- compute ----------------------------------------------------------------------------
    def _run(self, x: Any, target: Any, scale: float, *, with_loss: bool = True) -> torch.Tensor:
        h = x
        for j, layer in enumerate(self.layers):
            try:
                h = layer(h)
            except Exception as e:
                if j == 0 and not self.is_first:
                    prev = self.first_layer - 1
                    raise StageShapeError(
                        f"stage {self.index} cannot take the activation stage {self.index - 1} "
                        f"sent: received {shape_of(x)} from stage {self.index - 1} (which ends "
                        f"with layer {self.layer_names[prev]!r}, {self.layer_descriptions[prev]}); "
                        f"stage {self.index} starts with {self._layer(0)}: "
                        f"{type(e).__name__}: {e}",
                        stage=self.index,
                    ) from e
                raise PipelineError(
                    f"stage {self.index}, {self._layer(j)} failed on an input of {shape_of(h)}: "
                    f"{type(e).__name__}: {e}",
                    stage=self.index,
                ) from e
        if not self.is_last:
            if not isinstance(h, torch.Tensor):
                raise PipelineError(
                    f"stage {self.index} produced a {type(h).__name__} (its last layer is "
                    f"{self._layer(len(self.layers) - 1)}); stages exchange exactly one tensor",
                    stage=self.index,
                )
            return h
        if self.loss_fn is None or not with_loss:
            return h
        loss = self.loss_fn(h, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise PipelineError(
                f"the loss function returned {shape_of(loss)} on the last stage; it must return a "
                "scalar (use reduction='mean' or 'sum')",
                stage=self.index,
            )
        return loss * scale if scale != 1.0 else loss

    def forward(
        self, i: int, x: Any, *, recompute: bool, target: Any = None, scale: float = 1.0
    ) -> torch.Tensor:
        """Forward of micro-batch ``i``; returns the (detached) activation, or on the last stage
        the scaled loss. Kept for ``backward`` (or only its input, when ``recompute``)."""
        if isinstance(x, torch.Tensor) and not self.is_first and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        if recompute:
            rng = RNGSnapshot.capture(self.device)
            with torch.no_grad():
                out = self._run(x, target, scale)
            self._saved[i] = _Saved(x, None, rng, target, scale)
        else:
            with torch.enable_grad():
                out = self._run(x, target, scale)
            self._saved[i] = _Saved(x, out, None)
        return out.detach()

    def infer(self, x: Any) -> torch.Tensor:
        """Forward without autograd (prediction); nothing is kept."""
        with torch.no_grad():
            return self._run(x, None, 1.0, with_loss=False)

    def recompute(self, i: int) -> None:
        """Re-run the forward of micro-batch ``i`` if it was not kept, replaying its RNG state."""
        saved = self._saved[i]
        if saved.output is not None:
            return
        assert saved.rng is not None
        with replay_rng(saved.rng), frozen_buffers(self.module), torch.enable_grad():
            saved.output = self._run(saved.input, saved.target, saved.scale)

    def backward(self, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of micro-batch ``i`` given the gradient of its output (None on the last
        stage); returns the gradient of its input (None on the first stage)."""
        self.recompute(i)
        saved = self._saved.pop(i)
        out = saved.output
        assert out is not None
        if out.requires_grad and (self.is_last or grad is not None):
            if grad is not None and grad.shape != out.shape:
                raise PipelineError(
                    f"stage {self.index} got a gradient of shape {list(grad.shape)} for micro-batch "
                    f"{i} whose output has shape {list(out.shape)}",
                    stage=self.index,
                )
            torch.autograd.backward(out, grad)
        x = saved.input
        if self.is_first or not isinstance(x, torch.Tensor) or not x.requires_grad:
            return None
        return x.grad

    def clear(self) -> None:
        """Drop micro-batches in flight (after a failure)."""
        self._saved.clear()
