"""Carry out a schedule on this stage (its chunk, or its chunks under interleaved plans) for one
mini-batch: compute, exchange activations and gradients with the neighbouring chunks, and spread
a failure to every stage of the pipeline.

Messages: each link between chunks c and c + 1 has its own tag (c + 1). Its first activation of
a step travels with a header (shape, dtype, mini-batch size; for a tuple or dict flattened into
one tensor, its layout: ``boundary.py``), and so does its first gradient; the receiver checks it
and from then on both sides know every message's size (trailing dimensions fixed within a step,
micro-batch sizes from the plan), so the other activations and gradients travel as raw payloads
with one status byte. After the plan, the result (the loss, or the predictions) travels with a
header from the last stage back to the first and an acknowledgement forward again (tag 0), so
every stage returns the same value and every message of the step has been received.

A stage that fails sends each neighbour an error marker shaped like the message that neighbour
waits for next from it (both know the plan, so both know which link that is), and the
neighbours pass it on: each stage only ever blocks in a receive from a neighbour, and that
neighbour sends either the expected message or the marker, so a failure reaches every stage fast.
Every marker sent is also received (``_notify``), so no stage waits for one nobody takes.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stratagem.comm.errors import WorkerFailedError
from stratagem.pipeline import boundary
from stratagem.pipeline.errors import PipelineError
from stratagem.pipeline.p2p import Channel, PostedRecv, RemoteStageError, raw_nbytes
from stratagem.pipeline.schedule import BACKWARD_KINDS, Action, Schedule, forward_only
from stratagem.pipeline.stage import Stage, shape_of

Spec = tuple[tuple[int, ...], torch.dtype]  # trailing dimensions and dtype


class _Links:
    """What one chunk has exchanged with its neighbouring chunks in this step, so that every
    message, error markers included, has the size the receiver expects. The activations and
    gradients crossing the cut between chunks ``c`` and ``c + 1`` travel with tag ``c + 1`` (tag 0
    is the step's handshake), so the links between the same two ranks never mix."""

    def __init__(self, stage: Stage, channel: Channel, sizes: Sequence[int], batch: int,
                 f_order: Sequence[int], b_order: Sequence[int], num_ranks: int) -> None:  # fmt: skip
        self.stage = stage
        self.channel = channel
        self.sizes = sizes
        self.batch = batch
        self.f_order = list(f_order)
        self.b_order = list(b_order)
        c = stage.index
        self.prev = (c - 1) % num_ranks  # the rank holding chunk c - 1 (unused on the first chunk)
        self.next = (c + 1) % num_ranks
        self.in_tag, self.out_tag = c, c + 1
        self.in_spec: Spec | None = None  # activations from chunk - 1
        self.out_spec: Spec | None = None  # activations to chunk + 1
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
        self.ahead_fwd = (j, self.channel.post_raw(self.prev, (self.sizes[j], *trailing), dtype, self.in_tag))

    def _post_next_grad(self) -> None:
        if self.out_spec is None or not self.out_spec[1].is_floating_point:
            return
        if self.got_bwd == 0 or self.got_bwd >= len(self.b_order):
            return  # the first gradient comes with a header
        j = self.b_order[self.got_bwd]
        trailing, dtype = self.out_spec
        self.ahead_bwd = (j, self.channel.post_raw(self.next, (self.sizes[j], *trailing), dtype, self.out_tag))

    # --- activations ------------------------------------------------------------------------
    def recv_activation(self, i: int) -> torch.Tensor:
        s = self.stage
        if self.in_spec is None:
            x = self.channel.recv(self.prev, self.in_tag)
            n = self.channel.last_extra
            s.boundary_in = boundary.decode(self.channel.last_meta)  # a tuple / dict's layout
            if x is not None and x.dim() > 0:  # the sender's next messages are shaped by it
                self.in_spec = (tuple(x.shape[1:]), x.dtype)
            if x is None or x.dim() == 0 or x.shape[0] != self.sizes[i] or n != self.batch:
                got = "nothing" if x is None else f"{shape_of(x)} (of a mini-batch of {n})"
                raise PipelineError(
                    f"stage {s.index} received {got} from stage {s.index - 1} for micro-batch {i}, "
                    f"which has {self.sizes[i]} examples (of {self.batch}) on stage {s.index}: every "
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
        if self.out_spec is None:
            if out.dim() == 0 or out.shape[0] != self.sizes[i]:
                raise PipelineError(
                    f"stage {s.index} produced {shape_of(out)} for micro-batch {i} of "
                    f"{self.sizes[i]} examples; activations between stages must keep the batch "
                    "as their first dimension",
                    stage=s.index,
                )
            self.channel.send(out, self.next, extra=self.batch, tag=self.out_tag, meta=boundary.encode(s.boundary_out))
            self.out_spec = (tuple(out.shape[1:]), out.dtype)
            self.out_layout = s.boundary_out
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
            self.channel.send_raw(out, self.next, raw_nbytes(tuple(out.shape), dtype), self.out_tag)
        self.sent_fwd += 1

    # --- gradients (only for floating-point activations) --------------------------------------
    def recv_grad(self, i: int) -> torch.Tensor | None:
        assert self.out_spec is not None
        if not self.out_spec[1].is_floating_point:
            return None
        if self.got_bwd == 0:
            # the first gradient of a link comes with a header, as the first activation does:
            # a stage that fails before it knows the gradients' shape can still tell its sender
            assert self.b_order[0] == i, "gradients out of plan order"
            self.got_bwd = 1
            grad = self.channel.recv(self.next, self.out_tag)
            self._post_next_grad()
            return grad
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
        if self.sent_bwd == 0:
            self.channel.send(grad, self.prev, tag=self.in_tag)
        else:
            self.channel.send_raw(grad, self.prev, nbytes, self.in_tag)
        self.sent_bwd += 1

    # --- failures -----------------------------------------------------------------------------
    def forward_marker(self) -> int | None:
        """The raw size of the next activation the next chunk waits for from this one, or None
        when it waits for a header message (the first activation)."""
        if self.sent_fwd > 0 and self.out_spec is not None:
            trailing, dtype = self.out_spec
            return raw_nbytes((self.sizes[self.f_order[self.sent_fwd]], *trailing), dtype)
        return None

    def sends_grads(self) -> bool | None:
        """Whether gradients travel back to the previous chunk (None: not known yet)."""
        return None if self.in_spec is None else self.in_spec[1].is_floating_point

    def backward_marker(self) -> int | None:
        """The raw size of the next gradient the previous chunk waits for from this one, or None
        when it waits for a header message (the first gradient)."""
        if self.sent_bwd == 0:
            return None
        return self._grad_nbytes(self.b_order[self.sent_bwd])


def _awaited(peer: Sequence[Action], peer_rank: int, links: dict[int, _Links], num_chunks: int) -> tuple[_Links, str] | None:
    """The first message the rank running ``peer`` needs from the chunks of ``links`` and has
    not been sent: (link, "F" for an activation or "B" for a gradient), or None (all sent: it
    waits for the handshake). Both ranks know the plan, so they agree on it."""
    taken: dict[tuple[str, int], int] = {}
    for a in peer:
        c = peer_rank if a.chunk is None else a.chunk
        if a.kind == "F" and c > 0 and c - 1 in links:
            link, kind = links[c - 1], "F"
        elif a.kind in BACKWARD_KINDS and c < num_chunks - 1 and c + 1 in links:
            link, kind = links[c + 1], "B"
            if link.sends_grads() is False:
                continue
        else:
            continue
        n = taken.get((kind, c), 0)
        taken[kind, c] = n + 1
        if (link.sent_fwd if kind == "F" else link.sent_bwd) <= n:
            return link, kind
    return None


#: how long an interrupted stage (Ctrl-C, kill -INT) spends telling its neighbours: they were
#: most likely stopped too, and one that was not learns from the closed connection anyway
INTERRUPT_WAIT_S = 1.0


def _notify(plan: Schedule | None, links: dict[int, _Links], rank: int, num_ranks: int, origin: int,
            message: str, starter: int, src: int | None, wait: float | None = None,
            gone: int | None = None) -> None:  # fmt: skip
    """Spread the news that stage ``origin`` failed, raised on rank ``starter`` (this rank, or
    learned from neighbour ``src``), and return once every marker sent or due has been received
    (or after the channel's ``error_wait``, or ``wait`` if given). ``gone``: a rank whose process
    is lost (dead, or on a host cut off): nothing is sent to it or awaited from it, as a send to
    a host that does not answer would hold this rank for the whole wait.

    Who sends what is fixed, so that each marker has a receiver: the starter tells every
    neighbouring rank; every other rank tells each neighbour but the starter (it may be blocked on
    this rank: a neighbour blocked on a third rank learns from that one) and receives a marker from
    each neighbour (the one from ``src`` already came). A marker is shaped as the message its
    receiver waits for next from the sender (on that link, or on the handshake): both know the plan."""
    if plan is None or not links:
        return
    channel = next(iter(links.values())).channel
    deadline = time.monotonic() + (channel.error_wait if wait is None else wait)
    handshake = {p for p in (rank - 1, rank + 1) if 0 <= p < num_ranks}
    ring = {ln.prev for ln in links.values() if not ln.stage.is_first}
    ring |= {ln.next for ln in links.values() if not ln.stage.is_last}  # rank 0 and K-1 when interleaved
    peers = sorted((handshake | ring) - {rank, gone})
    posted: list[Any] = []
    for peer in peers:
        if peer == starter:
            continue
        awaited = _awaited(plan[peer], peer, links, plan.num_chunks)
        if awaited is None:  # the handshake's result or acknowledgement
            if peer in handshake:
                posted += channel.post_error(peer, origin, message, starter=starter)
            continue
        link, kind = awaited
        nbytes, tag = (link.forward_marker(), link.out_tag) if kind == "F" else (link.backward_marker(), link.in_tag)
        posted += channel.post_error(peer, origin, message, starter=starter, nbytes=nbytes, tag=tag)
    if starter != rank:
        channel.deadline = deadline
        try:
            for peer in peers:
                if peer != src:
                    _take_marker(plan, links, channel, rank, peer, peer in handshake)
        finally:
            channel.deadline = None
    channel.wait_sent(posted, deadline)


def _take_marker(plan: Schedule, links: dict[int, _Links], channel: Channel, rank: int, peer: int,
                 handshake: bool) -> None:  # fmt: skip
    """Receive ``peer``'s error marker: it stands in for the first message of this rank's plan
    that ``peer`` has not sent (``_awaited`` on its side), so take ``peer``'s messages in plan
    order until it comes (on the handshake when every message was sent). Gives up at the
    channel's deadline, or if ``peer`` is gone."""
    taken: dict[tuple[str, int], int] = {}
    try:
        for a in plan[rank]:
            c = rank if a.chunk is None else a.chunk
            link = links.get(c)
            if link is None:
                continue
            if a.kind == "F" and not link.stage.is_first and link.prev == peer:
                kind = "F"
            elif a.kind in BACKWARD_KINDS and not link.stage.is_last and link.next == peer:
                kind = "B"
                if link.out_spec is not None and not link.out_spec[1].is_floating_point:
                    continue  # no gradients on this link
            else:
                continue
            n = taken.get((kind, c), 0)
            taken[kind, c] = n + 1
            if n < (link.got_fwd if kind == "F" else link.got_bwd):
                continue  # received before the failure
            try:
                if kind == "F":
                    link.recv_activation(a.microbatch)
                elif link.out_spec is None:
                    channel.recv(peer, link.out_tag)
                else:
                    link.recv_grad(a.microbatch)
            except PipelineError:
                pass  # a message that did not fit: the marker comes later
        if handshake:
            while True:
                channel.recv(peer, 0)
    except Exception:  # noqa: BLE001 - the marker came (RemoteStageError), the deadline passed, or the peer is gone
        return


def _chunks(stage: Stage | Sequence[Stage]) -> list[Stage]:
    return [stage] if isinstance(stage, Stage) else list(stage)


def _make_links(
    stages: list[Stage], channel: Channel | None, sizes: Sequence[int], actions: Sequence[Action]
) -> dict[int, _Links]:
    if channel is None:
        return {}
    num_ranks = stages[0].num_stages // len(stages)
    rank = stages[0].index
    out = {}
    for st in stages:
        mine = [a for a in actions if (rank if a.chunk is None else a.chunk) == st.index]
        f_order = [a.microbatch for a in mine if a.kind == "F"]
        b_order = [a.microbatch for a in mine if a.kind in BACKWARD_KINDS]
        out[st.index] = _Links(st, channel, sizes, sum(sizes), f_order, b_order, num_ranks)
    return out


def _layout_text(layout: boundary.Layout | None) -> str:
    return "a tensor" if layout is None else layout.describe()


def run_plan(
    actions: Sequence[Action],
    stage: Stage | Sequence[Stage],
    channel: Channel | None,
    inputs: Sequence[Any],
    targets: Sequence[Any],
    scales: Sequence[float],
    sizes: Sequence[int],
    recompute_below: int,
    *,
    on_last_backward: Callable[[bool], None] | None = None,
    plan: Schedule | None = None,
    before_backward: Callable[[Stage, bool], None] | None = None,
) -> torch.Tensor:
    """Train on one mini-batch; the summed scaled loss (the same on every stage).

    ``stage``: this rank's stage, or its chunks in model order (interleaved plans, whose actions
    name their chunk). ``on_last_backward(True)`` is called before the action that accumulates the
    last weight gradients of the step (the last B; with a split backward the last W, or the last I
    when no weight is left to W passes), ``on_last_backward(False)`` before the others. ``plan``:
    the whole schedule (``actions`` is one rank's part), so that a failure is told to each
    neighbour on the link it waits on. ``before_backward(chunk, last)`` is called before each
    whole backward (B) with whether it is that chunk's last of the step."""
    stages = _chunks(stage)
    rank = stages[0].index
    by_chunk = {st.index: st for st in stages}
    split = any(a.kind in ("I", "W") for a in actions)
    if split:
        for st in stages:
            st.split_backward()
    has_w = split and any(st.has_weight_pass() for st in stages)
    weight_kind = "W" if has_w else ("I" if split else "B")
    # the last action accumulating into a trainable parameter (a chunk without any, an activation
    # say, fires no gradient hook: the reducer would never start)
    trainable = {st.index for st in stages if any(p.requires_grad for p in st.module.parameters())}
    last_b = max(
        (n for n, a in enumerate(actions)
         if a.kind == weight_kind and (rank if a.chunk is None else a.chunk) in trainable),
        default=-1,
    )  # fmt: skip
    chunk_last_b = {}
    for n, a in enumerate(actions):
        if a.kind == "B":
            chunk_last_b[rank if a.chunk is None else a.chunk] = n
    links = _make_links(stages, channel, sizes, actions)
    # per action: its chunk's stage and links, resolved once
    steps = [(a.kind, a.microbatch, by_chunk[rank if a.chunk is None else a.chunk]) for a in actions]
    current = [rank]  # the chunk of the action under way: a failure names it

    rec = stages[0].recorder
    if rec is not None:
        rec.begin_step()
        clock = rec.clock

    def body() -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=stages[0].device)
        for n, (kind, i, st) in enumerate(steps):
            current[0] = st.index
            link = links.get(st.index)
            if rec is not None:
                t0 = clock()
                wait = 0.0
            if kind == "F":
                if st.is_first:
                    x = inputs[i]
                elif rec is not None:
                    w0 = clock()
                    x = _need(link).recv_activation(i)
                    wait = clock() - w0
                else:
                    x = _need(link).recv_activation(i)
                out = st.forward(
                    i, x, recompute=i < recompute_below,
                    target=targets[i] if st.is_last else None, scale=scales[i],
                )  # fmt: skip
                if st.is_last:
                    total += out.double()
                else:
                    _need(link).send_activation(i, out)
            elif kind == "W":
                if on_last_backward is not None:
                    on_last_backward(n == last_b)
                st.backward_weight(i)
            else:
                st.recompute(i)  # before waiting for the gradient: overlaps the next stage
                if rec is not None:
                    w0 = clock()
                grad = None if st.is_last else _need(link).recv_grad(i)
                if rec is not None:
                    wait = clock() - w0
                if on_last_backward is not None:
                    on_last_backward(n == last_b)
                if before_backward is not None and kind == "B":
                    before_backward(st, n == chunk_last_b[st.index])
                gin = st.backward(i, grad) if kind == "B" else st.backward_input(i, grad)
                if not st.is_first:
                    _need(link).send_grad(i, gin)
            if rec is not None:
                rec.add(kind, i, t0, clock(), wait, None if actions[n].chunk is None else st.index)
        return total

    return _with_handshake(stages, channel, links, plan, body, current)


def run_inference(
    stage: Stage | Sequence[Stage], channel: Channel | None, inputs: Sequence[Any], sizes: Sequence[int]
) -> torch.Tensor:
    """Forward every micro-batch through the pipeline (chunk by chunk); the joined output on every
    stage."""
    stages = _chunks(stage)
    v = len(stages)
    plan = forward_only(stages[0].num_stages // v, len(sizes), v)
    links = _make_links(stages, channel, sizes, plan[stages[0].index])

    def body() -> torch.Tensor:
        outs = []
        for st in stages:
            link = links.get(st.index)
            for i in range(len(sizes)):
                x = inputs[i] if st.is_first else _need(link).recv_activation(i)
                out = st.infer(x)
                if st.is_last:
                    outs.append(out)
                else:
                    _need(link).send_activation(i, out)
        return torch.cat(outs) if outs else torch.empty(0)

    return _with_handshake(stages, channel, links, plan, body)


def _need(links: _Links | None) -> _Links:
    assert links is not None
    return links


def _pipeline_rank(channel: Channel, job_rank: int) -> int | None:
    """The pipeline rank (the process's first stage) of the job's rank ``job_rank``."""
    ranks = getattr(channel.comm, "global_ranks", None)
    return ranks.index(job_rank) if ranks is not None and job_rank in ranks else None


def _job_rank(channel: Channel, pipeline_rank: int) -> int | None:
    """The job's rank of the process at ``pipeline_rank`` (None if not known)."""
    ranks = getattr(channel.comm, "global_ranks", None)
    return ranks[pipeline_rank] if ranks is not None and 0 <= pipeline_rank < len(ranks) else None


def _with_handshake(
    stages: list[Stage], channel: Channel | None, links: dict[int, _Links], plan: Schedule | None,
    body: Callable[[], torch.Tensor], current: list[int] | None = None,
) -> torch.Tensor:
    num_ranks = stages[0].num_stages // len(stages)
    if channel is None or num_ranks == 1:
        return body()
    rank = stages[0].index
    is_first, is_last = rank == 0, rank == num_ranks - 1
    try:
        result = body()
        # the result flows back from the last stage, then an acknowledgement forward
        if not is_last:
            got = channel.recv(rank + 1)
            assert got is not None
            result = got
        if not is_first:
            channel.send(result, rank - 1)
            channel.recv(rank - 1)
        if not is_last:
            channel.send(None, rank + 1)
        channel.flush()
        return result
    except RemoteStageError as e:
        for st in stages:
            st.clear()
        channel.abandon()
        starter = e.starter if e.starter >= 0 else e.src
        _notify(plan, links, rank, num_ranks, e.origin, e.message, starter=starter, src=e.src)
        raise PipelineError(f"stage {e.origin} failed: {e.message}", stage=e.origin,
                            follows_rank=_job_rank(channel, e.origin % num_ranks)) from None
    except BaseException as e:
        for st in stages:
            st.clear()
        channel.abandon()
        here = current[0] if current else rank
        if isinstance(e, WorkerFailedError) and e.rank is not None:
            # a peer process died or fell silent: this stage did not fail. The others are told
            # which process it was; this one raises the WorkerFailedError itself (one line)
            lost = _pipeline_rank(channel, e.rank)
            origin = lost if lost is not None else here
            _notify(plan, links, rank, num_ranks, origin, str(e), starter=rank, src=None, gone=lost)
            raise
        origin = e.stage if isinstance(e, PipelineError) and e.stage is not None else here
        message = str(e) if isinstance(e, PipelineError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, PipelineError):
            message += "\n" + "".join(traceback.format_exception(e)[-3:]).rstrip()
        wait = INTERRUPT_WAIT_S if isinstance(e, KeyboardInterrupt) else None
        _notify(plan, links, rank, num_ranks, origin, message, starter=rank, src=None, wait=wait)
        if isinstance(e, PipelineError) or not isinstance(e, Exception):
            raise  # a Ctrl-C stays a KeyboardInterrupt (a program's `except KeyboardInterrupt:` sees it)
        raise PipelineError(f"stage {here} failed: {type(e).__name__}: {e}", stage=here) from e
