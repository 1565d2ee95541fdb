"""Carry out a schedule on this stage for one mini-batch: compute, exchange activations and
gradients with the neighbouring stages, and spread a failure to every stage of the pipeline.

Messages: the first activation of a step travels with a header (shape, dtype, mini-batch size;
for a tuple or dict flattened into one tensor, its layout: ``boundary.py``); the receiver checks
it and from then on both sides know every message's size (trailing dimensions fixed within a
step, micro-batch sizes from the plan), so the other activations and all gradients travel as raw
payloads with one status byte. After the plan, the result (the loss,
or the predictions) travels with a header from the last stage back to the first and an
acknowledgement forward again, so every stage returns the same value and every message of the
step has been received.

A stage that fails sends each neighbour an error marker shaped like the message that neighbour
waits for next, and the neighbours pass it on: each stage only ever blocks in a receive from a
neighbour, and that neighbour sends either the expected message or the marker, so a failure
reaches every stage fast.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stratagem.pipeline import boundary
from stratagem.pipeline.errors import PipelineError
from stratagem.pipeline.p2p import Channel, PostedRecv, RemoteStageError, raw_nbytes
from stratagem.pipeline.schedule import BACKWARD_KINDS, Action
from stratagem.pipeline.stage import Stage, shape_of

Spec = tuple[tuple[int, ...], torch.dtype]  # trailing dimensions and dtype


class _Links:
    """What this stage has exchanged with its neighbours in this step, so that every message,
    error markers included, has the size the receiver expects."""

    def __init__(self, stage: Stage, channel: Channel, sizes: Sequence[int], batch: int,
                 f_order: Sequence[int], b_order: Sequence[int]) -> None:  # fmt: skip
        self.stage = stage
        self.channel = channel
        self.sizes = sizes
        self.batch = batch
        self.f_order = list(f_order)
        self.b_order = list(b_order)
        self.in_spec: Spec | None = None  # activations from stage - 1
        self.out_spec: Spec | None = None  # activations to stage + 1
        self.out_layout: boundary.Layout | None = None  # a tuple / dict sent as one carrier
        self.sent_fwd = 0
        self.sent_bwd = 0
        # the next raw activation / gradient, received ahead (its transfer overlaps compute)
        self.got_fwd = 0
        self.got_bwd = 0
        self.ahead_fwd: tuple[int, PostedRecv] | None = None
        self.ahead_bwd: tuple[int, PostedRecv] | None = None

    def _post_next_activation(self) -> None:
        """Post the receive of the activation after the ones taken so far, if one will come."""
        if self.in_spec is None or self.got_fwd >= len(self.f_order):
            return
        j = self.f_order[self.got_fwd]
        trailing, dtype = self.in_spec
        self.ahead_fwd = (j, self.channel.post_raw(self.stage.index - 1, (self.sizes[j], *trailing), dtype))

    def _post_next_grad(self) -> None:
        if self.out_spec is None or not self.out_spec[1].is_floating_point:
            return
        if self.got_bwd >= len(self.b_order):
            return
        j = self.b_order[self.got_bwd]
        trailing, dtype = self.out_spec
        self.ahead_bwd = (j, self.channel.post_raw(self.stage.index + 1, (self.sizes[j], *trailing), dtype))

    # --- activations ------------------------------------------------------------------------
    def recv_activation(self, i: int) -> torch.Tensor:
        s = self.stage
        src = s.index - 1
        if self.in_spec is None:
            x = self.channel.recv(src)
            n = self.channel.last_extra
            s.boundary_in = boundary.decode(self.channel.last_meta)  # a tuple / dict's layout
            if x is not None and x.dim() > 0:  # the sender's next messages are shaped by it
                self.in_spec = (tuple(x.shape[1:]), x.dtype)
            if x is None or x.dim() == 0 or x.shape[0] != self.sizes[i] or n != self.batch:
                got = "nothing" if x is None else f"{shape_of(x)} (of a mini-batch of {n})"
                raise PipelineError(
                    f"stage {s.index} received {got} from stage {src} for micro-batch {i}, which "
                    f"has {self.sizes[i]} examples (of {self.batch}) on stage {s.index}: every "
                    "stage of a pipeline must be given the same mini-batch (call "
                    "strategy.run(pipe.train_step, ...) with the same data on every process of "
                    "the pipeline)",
                    stage=s.index,
                )
            self.got_fwd = 1
            self._post_next_activation()
            return x
        if self.ahead_fwd is None:
            self._post_next_activation()
        assert self.ahead_fwd is not None and self.ahead_fwd[0] == i, "activations out of plan order"
        posted, self.ahead_fwd = self.ahead_fwd[1], None
        self.got_fwd += 1
        x = self.channel.finish_raw(posted)
        # one receive ahead at most: after an error marker the sender's full message follows
        # as a header message, which a second raw receive posted ahead would mismatch
        self._post_next_activation()
        assert x is not None
        return x

    def send_activation(self, i: int, out: torch.Tensor) -> None:
        s = self.stage
        dst = s.index + 1
        if self.out_spec is None:
            if out.dim() == 0 or out.shape[0] != self.sizes[i]:
                raise PipelineError(
                    f"stage {s.index} produced {shape_of(out)} for micro-batch {i} of "
                    f"{self.sizes[i]} examples; activations between stages must keep the batch "
                    "as their first dimension",
                    stage=s.index,
                )
            self.channel.send(out, dst, extra=self.batch, meta=boundary.encode(s.boundary_out))
            self.out_spec = (tuple(out.shape[1:]), out.dtype)
            self.out_layout = s.boundary_out
            if self.b_order and self.ahead_bwd is None and self.got_bwd == 0:
                self._post_next_grad()  # the first gradient's transfer overlaps the forwards
        else:
            trailing, dtype = self.out_spec
            if s.boundary_out != self.out_layout:
                raise PipelineError(
                    f"stage {s.index} produced {_layout_text(s.boundary_out)} for micro-batch {i} but "
                    f"{_layout_text(self.out_layout)} for the first one; within a mini-batch, what "
                    "crosses a stage boundary must keep its structure, dtypes and shapes apart from the "
                    "batch dimension",
                    stage=s.index,
                )
            if tuple(out.shape) != (self.sizes[i], *trailing) or out.dtype != dtype:
                raise PipelineError(
                    f"stage {s.index} produced {shape_of(out)} for micro-batch {i} but "
                    f"[{self.sizes[i]}, {', '.join(map(str, trailing))}] ({dtype}) for the first "
                    "one; within a mini-batch, activations between stages must keep their shape "
                    "apart from the batch dimension",
                    stage=s.index,
                )
            self.channel.send_raw(out, dst, raw_nbytes(tuple(out.shape), dtype))
        self.sent_fwd += 1

    # --- gradients (only for floating-point activations) --------------------------------------
    def recv_grad(self, i: int) -> torch.Tensor | None:
        assert self.out_spec is not None
        if not self.out_spec[1].is_floating_point:
            return None
        if self.ahead_bwd is None:
            self._post_next_grad()
        assert self.ahead_bwd is not None and self.ahead_bwd[0] == i, "gradients out of plan order"
        posted, self.ahead_bwd = self.ahead_bwd[1], None
        self.got_bwd += 1
        grad = self.channel.finish_raw(posted)
        self._post_next_grad()
        return grad

    def _grad_nbytes(self, i: int) -> int | None:
        if self.in_spec is None or not self.in_spec[1].is_floating_point:
            return None
        trailing, dtype = self.in_spec
        return raw_nbytes((self.sizes[i], *trailing), dtype)

    def send_grad(self, i: int, grad: torch.Tensor | None) -> None:
        nbytes = self._grad_nbytes(i)
        if nbytes is None:
            return
        self.channel.send_raw(grad, self.stage.index - 1, nbytes)
        self.sent_bwd += 1

    # --- failures -----------------------------------------------------------------------------
    def notify(self, origin: int, message: str, skip: int | None) -> None:
        """Send ``message`` to each neighbour but ``skip``, shaped as it expects next."""
        s = self.stage
        nxt, prev = s.index + 1, s.index - 1
        if nxt < s.num_stages and nxt != skip:
            if 0 < self.sent_fwd < len(self.f_order) and self.out_spec is not None:
                trailing, dtype = self.out_spec
                j = self.f_order[self.sent_fwd]
                self.channel.send_error_raw(nxt, raw_nbytes((self.sizes[j], *trailing), dtype), origin, message)
            else:  # the first activation or the acknowledgement: a header message
                self.channel.send_error(nxt, origin, message)
        if prev >= 0 and prev != skip:
            if self.in_spec is None and self.b_order:
                try:  # learn the gradient shape from the first activation, still on its way
                    x = self.channel.recv(prev)
                    if x is not None:
                        self.in_spec = (tuple(x.shape[1:]), x.dtype)
                except RemoteStageError:
                    return  # stage - 1 failed as well: it waits for nothing
                except Exception:  # noqa: BLE001
                    pass
            nbytes = None
            if self.sent_bwd < len(self.b_order):
                nbytes = self._grad_nbytes(self.b_order[self.sent_bwd])
            if nbytes is not None:
                self.channel.send_error_raw(prev, nbytes, origin, message)
            else:  # the result of the step: a header message
                self.channel.send_error(prev, origin, message)


def _layout_text(layout: boundary.Layout | None) -> str:
    return "a tensor" if layout is None else layout.describe()


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
    """Train on one mini-batch; the summed scaled loss (the same on every stage).

    ``on_last_backward(True)`` is called before the action that accumulates the last weight
    gradients of the step (the last B; with a split backward the last W, or the last I when no
    weight is left to W passes), ``on_last_backward(False)`` before the others."""
    split = any(a.kind in ("I", "W") for a in actions)
    if split:
        stage.split_backward()
    weight_kind = "W" if split and stage.has_weight_pass() else ("I" if split else "B")
    last_b = max((n for n, a in enumerate(actions) if a.kind == weight_kind), default=-1)
    f_order = [a.microbatch for a in actions if a.kind == "F"]
    b_order = [a.microbatch for a in actions if a.kind in BACKWARD_KINDS]
    links = _Links(stage, channel, sizes, sum(sizes), f_order, b_order) if channel else None

    rec = stage.recorder
    if rec is not None:
        rec.begin_step()
        clock = rec.clock

    def body() -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=stage.device)
        for n, a in enumerate(actions):
            i = a.microbatch
            if rec is not None:
                t0 = clock()
                wait = 0.0
            if a.kind == "F":
                if stage.is_first:
                    x = inputs[i]
                elif rec is not None:
                    w0 = clock()
                    x = _need(links).recv_activation(i)
                    wait = clock() - w0
                else:
                    x = _need(links).recv_activation(i)
                out = stage.forward(
                    i, x, recompute=i < recompute_below,
                    target=targets[i] if stage.is_last else None, scale=scales[i],
                )  # fmt: skip
                if stage.is_last:
                    total += out.double()
                else:
                    _need(links).send_activation(i, out)
            elif a.kind == "W":
                if on_last_backward is not None:
                    on_last_backward(n == last_b)
                stage.backward_weight(i)
            else:
                stage.recompute(i)  # before waiting for the gradient: overlaps the next stage
                if rec is not None:
                    w0 = clock()
                grad = None if stage.is_last else _need(links).recv_grad(i)
                if rec is not None:
                    wait = clock() - w0
                if on_last_backward is not None:
                    on_last_backward(n == last_b)
                gin = stage.backward(i, grad) if a.kind == "B" else stage.backward_input(i, grad)
                if not stage.is_first:
                    _need(links).send_grad(i, gin)
            if rec is not None:
                rec.add(a.kind, i, t0, clock(), wait)
        return total

    return _with_handshake(stage, links, body)


def run_inference(
    stage: Stage, channel: Channel | None, inputs: Sequence[Any], sizes: Sequence[int]
) -> torch.Tensor:
    """Forward every micro-batch through the pipeline; the joined output on every stage."""
    order = list(range(len(sizes)))
    links = _Links(stage, channel, sizes, sum(sizes), order, []) if channel else None

    def body() -> torch.Tensor:
        outs = []
        for i in order:
            x = inputs[i] if stage.is_first else _need(links).recv_activation(i)
            out = stage.infer(x)
            if stage.is_last:
                outs.append(out)
            else:
                _need(links).send_activation(i, out)
        return torch.cat(outs) if stage.is_last else torch.empty(0)

    return _with_handshake(stage, links, body)


def _need(links: _Links | None) -> _Links:
    assert links is not None
    return links


def _with_handshake(stage: Stage, links: _Links | None, body: Callable[[], torch.Tensor]) -> torch.Tensor:
    if links is None or stage.num_stages == 1:
        return body()
    channel = links.channel
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
        sender = stage.index - 1 if e.origin < stage.index else stage.index + 1
        links.notify(e.origin, e.message, skip=sender)
        raise PipelineError(f"stage {e.origin} failed: {e.message}", stage=e.origin) from None
    except BaseException as e:
        stage.clear()
        channel.abandon()
        origin = e.stage if isinstance(e, PipelineError) and e.stage is not None else stage.index
        message = str(e) if isinstance(e, PipelineError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, PipelineError):
            message += "\n" + "".join(traceback.format_exception(e)[-3:]).rstrip()
        links.notify(origin, message, skip=None)
        if isinstance(e, PipelineError):
            raise
        raise PipelineError(f"stage {stage.index} failed: {type(e).__name__}: {e}", stage=stage.index) from e
