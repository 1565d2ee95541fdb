"""Carry out a schedule on this stage for one mini-batch: compute, exchange activations and
gradients with the neighbouring stages, and spread a failure to every stage of the pipeline.

After the plan, the result (the loss, or the predictions) travels from the last stage back to
the first and an acknowledgement forward again, so every stage returns the same value and every
message of the step has been received. A stage that fails sends an error marker to its
neighbours, which pass it on: each stage only ever blocks in a receive from a neighbour, and that
neighbour either sends what was expected or the marker, so a failure reaches every stage fast.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stratagem.pipeline.errors import PipelineError
from stratagem.pipeline.p2p import Channel, RemoteStageError
from stratagem.pipeline.schedule import Action
from stratagem.pipeline.stage import Stage


def _neighbours(stage: Stage) -> list[int]:
    return [s for s in (stage.index - 1, stage.index + 1) if 0 <= s < stage.num_stages]


def _check_batch(stage: Stage, x: torch.Tensor | None, i: int, expected: int) -> torch.Tensor:
    if x is None or x.dim() == 0 or x.shape[0] != expected:
        got = "nothing" if x is None else f"shape {list(x.shape)}"
        raise PipelineError(
            f"stage {stage.index} received {got} from stage {stage.index - 1} for micro-batch {i}, "
            f"which has {expected} examples on stage {stage.index}: every stage of a pipeline must "
            "be given the same mini-batch (call strategy.run(pipe.train_step, ...) with the same "
            "data on every process of the pipeline)",
            stage=stage.index,
        )
    return x


def run_plan(
    actions: Sequence[Action],
    stage: Stage,
    channel: Channel | None,
    inputs: Sequence[Any],
    targets: Sequence[Any],
    scales: Sequence[float],
    sizes: Sequence[int],
    recompute_below: int,
    *,
    on_last_backward: Callable[[bool], None] | None = None,
) -> torch.Tensor:
    """Train on one mini-batch; the summed scaled loss (the same on every stage)."""
    last_b = max((n for n, a in enumerate(actions) if a.kind == "B"), default=-1)

    def body() -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=stage.device)
        for n, a in enumerate(actions):
            i = a.microbatch
            if a.kind == "F":
                if stage.is_first:
                    x = inputs[i]
                else:
                    assert channel is not None
                    x = _check_batch(stage, channel.recv(stage.index - 1), i, sizes[i])
                out = stage.forward(
                    i, x, recompute=i < recompute_below,
                    target=targets[i] if stage.is_last else None, scale=scales[i],
                )  # fmt: skip
                if stage.is_last:
                    total += out.double()
                else:
                    assert channel is not None
                    channel.send(out, stage.index + 1)
            else:
                stage.recompute(i)  # before waiting for the gradient: overlaps the next stage
                grad = None
                if not stage.is_last:
                    assert channel is not None
                    grad = channel.recv(stage.index + 1)
                if on_last_backward is not None:
                    on_last_backward(n == last_b)
                gin = stage.backward(i, grad)
                if not stage.is_first:
                    assert channel is not None
                    channel.send(gin, stage.index - 1)
        return total

    return _with_handshake(stage, channel, body)


def run_inference(
    stage: Stage, channel: Channel | None, inputs: Sequence[Any], sizes: Sequence[int]
) -> torch.Tensor:
    """Forward every micro-batch through the pipeline; the joined output on every stage."""

    def body() -> torch.Tensor:
        outs = []
        for i in range(len(sizes)):
            if stage.is_first:
                x = inputs[i]
            else:
                assert channel is not None
                x = _check_batch(stage, channel.recv(stage.index - 1), i, sizes[i])
            out = stage.infer(x)
            if stage.is_last:
                outs.append(out)
            else:
                assert channel is not None
                channel.send(out, stage.index + 1)
        return torch.cat(outs) if stage.is_last else torch.empty(0)

    return _with_handshake(stage, channel, body)


def _with_handshake(stage: Stage, channel: Channel | None, body: Callable[[], torch.Tensor]) -> torch.Tensor:
    if channel is None or stage.num_stages == 1:
        return body()
    try:
        result = body()
        # the result flows back from the last stage, then an acknowledgement forward
        if not stage.is_last:
            got = channel.recv(stage.index + 1)
            assert got is not None
            result = got
        if not stage.is_first:
            channel.send(result, stage.index - 1)
            channel.recv(stage.index - 1)
        if not stage.is_last:
            channel.send(None, stage.index + 1)
        channel.flush()
        return result
    except RemoteStageError as e:
        stage.clear()
        channel.abandon()
        for peer in _neighbours(stage):
            if abs(peer - e.origin) > abs(stage.index - e.origin):  # pass it on, away from the origin
                channel.send_error(peer, e.origin, e.message)
        raise PipelineError(f"stage {e.origin} failed: {e.message}", stage=e.origin) from None
    except BaseException as e:
        stage.clear()
        channel.abandon()
        origin = e.stage if isinstance(e, PipelineError) and e.stage is not None else stage.index
        message = str(e) if isinstance(e, PipelineError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, PipelineError):
            message += "\n" + "".join(traceback.format_exception(e)[-3:]).rstrip()
        for peer in _neighbours(stage):
            channel.send_error(peer, origin, message)
        if isinstance(e, PipelineError):
            raise
        raise PipelineError(f"stage {stage.index} failed: {type(e).__name__}: {e}", stage=stage.index) from e
