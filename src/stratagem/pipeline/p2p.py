"""Point-to-point messages between the stages of one pipeline: a fixed-size header (kind, dtype,
shape, length of a metadata blob) then the payload and the blob, so the receiver can allocate; or, once both sides know the shape, a raw
payload with one status byte appended. An error marker in place of the expected message tells a
neighbour that a stage failed, so no process stays blocked in a receive.

Sends are non-blocking (gloo's send only completes once the peer posts the matching receive, so
blocking sends could deadlock a 1F1B schedule); receives block. Message sizes always match
exactly: a mismatched size aborts a gloo process.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from stratagem.comm import Communicator, ProcessGroupCommunicator
from stratagem.comm.communicator import classify_failure
from stratagem.comm.failure import in_collective

TENSOR, NONE, ERROR = 1, 2, 3
MAX_DIMS = 8
HEADER = 5 + MAX_DIMS  # kind, dtype, extra, ndim, dims..., metadata bytes (the last)
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip


def raw_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


class RemoteStageError(Exception):
    """A neighbour (stage ``src``) reported that stage ``origin`` failed with ``message``;
    ``starter``: the rank that raised it and began spreading the news (-1: not known)."""

    def __init__(self, origin: int, message: str, src: int = -1, starter: int = -1) -> None:
        super().__init__(message)
        self.origin = origin
        self.message = message
        self.src = src
        self.starter = starter


class PostedRecv:
    """A raw receive posted ahead of need (``Channel.post_raw``), finished by ``finish_raw``."""

    __slots__ = ("work", "buf", "src", "shape", "dtype", "tag")

    def __init__(self, work: Any, buf: torch.Tensor, src: int, shape: tuple[int, ...], dtype: torch.dtype,
                 tag: int = 0) -> None:  # fmt: skip
        self.work, self.buf, self.src, self.shape, self.dtype, self.tag = work, buf, src, shape, dtype, tag


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_uses(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s storage (None where torch does not say)."""
    return None if _USE_COUNT is None else int(_USE_COUNT(t.untyped_storage()._cdata))


class _Buffers:
    """The raw messages' buffers on a CPU stage, kept from one step to the next.

    A step sends and receives the same messages as the one before it, so the n-th buffer of a
    (direction, peer, tag, size) is reused by the next step's n-th message of that kind: without
    it, each message allocated a fresh buffer just above glibc's mmap threshold (a 32 x 1024
    float32 activation plus its status byte), and the page faults of that memory cost 3-4% of an
    interleaved step's CPU. A received buffer is reused only when no tensor but the pool's own
    still shares its storage (a module that keeps its input keeps its buffer; the next step gets a
    new one); a sent buffer once ``end_step`` is called, after every send of the step completed.
    Buffers not used in a step are dropped, so batches of changing sizes hold no more than one
    step's messages."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reuse = device.type == "cpu" and _USE_COUNT is not None
        self.held: dict[tuple[Any, ...], list[tuple[torch.Tensor, int | None]]] = {}
        self.taken: dict[tuple[Any, ...], int] = {}

    def get(self, key: tuple[Any, ...], nbytes: int) -> torch.Tensor:
        if not self.reuse:
            return torch.empty(nbytes + 1, dtype=torch.uint8, device=self.device)
        key = (*key, nbytes)
        held = self.held.setdefault(key, [])
        n = self.taken.get(key, 0)
        self.taken[key] = n + 1
        if n < len(held):
            buf, alone = held[n]
            if _storage_uses(buf) == alone:
                return buf
        buf = torch.empty(nbytes + 1, dtype=torch.uint8, device=self.device)
        entry = (buf, _storage_uses(buf))
        if n < len(held):
            held[n] = entry
        else:
            held.append(entry)
        return buf

    def end_step(self) -> None:
        """The step's sends completed: its buffers may serve the next step."""
        self.held = {k: v[: self.taken[k]] for k, v in self.held.items() if k in self.taken}
        self.taken = {}

    def drop(self) -> None:
        """Forget every buffer (after a failure a send may still read from one)."""
        self.held, self.taken = {}, {}


class Channel:
    """The messages this stage exchanges with its neighbours (ranks of the pipeline group)."""

    def __init__(self, comm: Communicator, *, upstream: Communicator | None = None, error_wait: float = 10.0) -> None:
        if comm.world_size > 1 and not isinstance(comm, ProcessGroupCommunicator):
            raise TypeError(f"pipeline stages need a torch.distributed group, got {type(comm).__name__}")
        if upstream is not None and (
            not isinstance(upstream, ProcessGroupCommunicator) or upstream.world_size != comm.world_size
        ):
            raise TypeError("the upstream group must be a torch.distributed group of the same ranks")
        self.comm = comm
        # messages to a lower rank (gradients, results) travel on a group of their own: gloo
        # serves each pair of processes with one connection and one lock, so a gradient coming
        # in while an activation goes out would wait for it (and the other way round)
        self.up = upstream
        self.device = comm.device
        self.error_wait = error_wait
        self._pending: list[tuple[Any, tuple[torch.Tensor, ...]]] = []
        self._abandoned: list[tuple[Any, tuple[torch.Tensor, ...]]] = []  # sends of failed steps
        self.last_extra = 0
        self.last_meta = b""
        self._buffers = _Buffers(torch.device(self.device))
        #: while set (a ``time.monotonic()`` value), receives give up then (TimeoutError)
        self.deadline: float | None = None

    def _group(self, sender: int, receiver: int) -> Any:
        assert isinstance(self.comm, ProcessGroupCommunicator)
        if self.up is not None and sender > receiver:
            assert isinstance(self.up, ProcessGroupCommunicator)
            return self.up.group
        return self.comm.group

    def _peer(self, rank: int) -> int:
        assert isinstance(self.comm, ProcessGroupCommunicator)
        return self.comm.global_ranks[rank]

    def _fail(self, e: BaseException, what: str) -> BaseException:
        probe = getattr(self.comm, "probe", None)
        return classify_failure(e, probe, what)

    def _isend(self, tensors: tuple[torch.Tensor, ...], dst: int, tag: int = 0) -> list[Any]:
        assert isinstance(self.comm, ProcessGroupCommunicator)
        works = []
        try:
            for t in tensors:
                works.append(dist.isend(t, dst=self._peer(dst), group=self._group(self.comm.rank, dst), tag=tag))
        except (RuntimeError, dist.DistError) as e:
            raise self._fail(e, f"send to stage {dst}") from e
        for w in works:
            self._pending.append((w, tensors))
        return works

    def _recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        assert isinstance(self.comm, ProcessGroupCommunicator)
        try:
            self._wait_recv(dist.irecv(tensor, src=self._peer(src), group=self._group(src, self.comm.rank), tag=tag))
        except (RuntimeError, dist.DistError) as e:
            raise self._fail(e, f"receive from stage {src}") from e

    def _wait_recv(self, work: Any) -> None:
        """Wait for a receive: without limit, or until ``deadline`` (then TimeoutError). Marked
        as a collective under way: once the failure monitor knows of a failed peer, a stage
        blocked here is stopped at once, not after the grace meant for a stage still computing
        (a stage waiting on a peer whose host vanished heard of it only as the store going away,
        and waited that grace: 11.5 s where the bound across hosts is 10 s)."""
        with in_collective():
            if self.deadline is None:
                work.wait()
                return
            left = self.deadline - time.monotonic()
            try:
                done = left > 0 and work.wait(timeout=datetime.timedelta(seconds=left))
            except (RuntimeError, dist.DistError) as e:  # gloo raises on a timeout: no probing then
                raise TimeoutError(f"no message before the deadline ({str(e).splitlines()[0] if str(e) else ''})") from e
        if not done:
            raise TimeoutError("no message before the deadline")

    # --- messages ---------------------------------------------------------------------------
    def send(
        self, value: torch.Tensor | None, dst: int, *, extra: int = 0, tag: int = 0, meta: bytes = b""
    ) -> None:
        """Queue ``value`` (a tensor, or None) with its header for stage ``dst``; returns at once.
        ``extra`` (an integer) travels in the header (``recv`` puts it in ``last_extra``), ``meta``
        (bytes: a boundary layout) after the payload (``recv`` puts it in ``last_meta``); ``tag``
        keeps apart the messages of different links between the same two stages."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        if value is None:
            header[0] = NONE
            self._isend((header.to(self.device),), dst, tag)
            return
        if value.dim() > MAX_DIMS or value.dtype not in DTYPES:
            raise TypeError(
                f"cannot send a tensor of shape {tuple(value.shape)} and dtype {value.dtype} "
                f"between stages (at most {MAX_DIMS} dimensions, dtypes {DTYPES})"
            )
        header[0] = TENSOR
        header[1] = DTYPES.index(value.dtype)
        header[2] = extra
        header[3] = value.dim()
        header[4 : 4 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
        header[-1] = len(meta)
        parts: tuple[torch.Tensor, ...] = (header.to(self.device),)
        payload = value.detach().to(self.device).contiguous()
        if payload.numel():
            parts += (payload,)
        if meta:
            parts += (torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device),)
        self._isend(parts, dst, tag)

    def recv(self, src: int, tag: int = 0) -> torch.Tensor | None:
        """The next message from stage ``src``; RemoteStageError if it reports a failure."""
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        self._recv(header, src, tag)
        return self.recv_after_header(header, src, tag)

    def recv_after_header(self, header: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor | None:
        """The rest of the message whose ``header`` came from ``src``."""
        h = header.tolist()
        if h[0] == NONE:
            return None
        if h[0] == ERROR:
            buf = torch.empty(int(h[2]), dtype=torch.uint8, device=self.device)
            if buf.numel():
                self._recv(buf, src, tag)
            text = bytes(buf.cpu().tolist()).decode("utf-8", "replace")
            raise RemoteStageError(int(h[1]), text, src, starter=int(h[3]) - 1)
        if h[0] != TENSOR:
            raise RuntimeError(f"malformed pipeline message from stage {src}: header {h}")
        shape = tuple(int(d) for d in h[4 : 4 + int(h[3])])
        out = torch.empty(shape, dtype=DTYPES[int(h[1])], device=self.device)
        self.last_extra = int(h[2])
        if out.numel():
            self._recv(out, src, tag)
        self.last_meta = b""
        if h[-1] > 0:
            meta = torch.empty(int(h[-1]), dtype=torch.uint8, device=self.device)
            self._recv(meta, src, tag)
            self.last_meta = bytes(meta.cpu().numpy().tobytes())
        return out

    # --- raw messages: shape agreed beforehand, one status byte appended ------------------------
    def send_raw(self, value: torch.Tensor | None, dst: int, nbytes: int, tag: int = 0) -> None:
        """Queue ``value`` as ``nbytes`` raw bytes plus a status byte (None: status NONE); the
        receiver already knows its shape and dtype (``recv_raw``)."""
        buf = self._buffers.get(("send", dst, tag), nbytes)
        if value is None:
            buf[-1] = NONE
        else:
            flat = value.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8)
            if flat.numel() != nbytes:
                raise RuntimeError(f"internal: raw message of {flat.numel()} bytes, {nbytes} agreed")
            buf[:-1].copy_(flat)
            buf[-1] = TENSOR
        self._isend((buf,), dst, tag)

    def recv_raw(self, src: int, shape: tuple[int, ...], dtype: torch.dtype, tag: int = 0) -> torch.Tensor | None:
        """The next raw message from ``src``: a tensor of ``shape`` and ``dtype``, or None;
        RemoteStageError if ``src`` reports a failure instead."""
        return self.finish_raw(self.post_raw(src, shape, dtype, tag))

    def post_raw(self, src: int, shape: tuple[int, ...], dtype: torch.dtype, tag: int = 0) -> PostedRecv:
        """Post the receive of the next raw message from ``src`` now, so the transfer overlaps
        the computation until ``finish_raw`` (gloo moves a message only once it is posted)."""
        assert isinstance(self.comm, ProcessGroupCommunicator)
        nbytes = raw_nbytes(shape, dtype)
        buf = self._buffers.get(("recv", src, tag), nbytes)
        try:
            work = dist.irecv(buf, src=self._peer(src), group=self._group(src, self.comm.rank), tag=tag)
        except (RuntimeError, dist.DistError) as e:
            raise self._fail(e, f"receive from stage {src}") from e
        return PostedRecv(work, buf, src, shape, dtype, tag)

    def finish_raw(self, posted: PostedRecv) -> torch.Tensor | None:
        """Wait for a posted raw receive; the tensor, None, or RemoteStageError."""
        try:
            self._wait_recv(posted.work)
        except (RuntimeError, dist.DistError) as e:
            raise self._fail(e, f"receive from stage {posted.src}") from e
        buf, src, shape, dtype = posted.buf, posted.src, posted.shape, posted.dtype
        nbytes = buf.numel() - 1
        status = int(buf[-1])
        if status == ERROR:
            # the marker holds the origin and the start of the message; the whole message follows
            # (it may be lost if the failing process exits at once: use the start then)
            origin, short = src, b""
            if nbytes >= 8:
                head = buf[:8].cpu().view(torch.int32).tolist()
                origin = int(head[0])
                short = bytes(buf[8 : 8 + max(0, min(int(head[1]), nbytes - 8))].cpu().tolist())
            try:
                self.recv(src, posted.tag)
            except RemoteStageError:
                raise
            except Exception:  # noqa: BLE001
                pass
            raise RemoteStageError(origin, short.decode("utf-8", "replace"), src)
        if status == NONE:
            return None
        return buf[:-1].view(dtype).view(shape)

    def post_error(self, dst: int, origin: int, message: str, *, starter: int, nbytes: int | None = None,
                   tag: int = 0) -> list[Any]:  # fmt: skip
        """Queue, for stage ``dst``, the news that stage ``origin`` failed (``starter``: the rank
        that raised it), shaped as the message ``dst`` waits for next on ``tag``: a raw message of
        ``nbytes`` bytes (a marker holding the origin and the start of ``message``, the whole
        message following as a header message), or (``nbytes=None``) a header message. Returns
        the sends' works ([] if the peer is gone)."""
        data = message.encode("utf-8")[:65536]
        parts: list[torch.Tensor] = []
        if nbytes is not None:
            buf = torch.zeros(nbytes + 1, dtype=torch.uint8)
            if nbytes >= 8:
                text = data[: nbytes - 8]
                buf[:8] = torch.tensor([origin, len(text)], dtype=torch.int32).view(torch.uint8)
                buf[8 : 8 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
            buf[-1] = ERROR
            parts.append(buf)
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0], header[1], header[2], header[3] = ERROR, origin, len(data), starter + 1
        parts.append(header)
        if data:
            parts.append(torch.tensor(list(data), dtype=torch.uint8))
        try:
            return self._isend(tuple(t.to(self.device) for t in parts), dst, tag)
        except Exception:  # noqa: BLE001 - the peer may be gone already
            return []

    def wait_sent(self, works: list[Any], deadline: float) -> bool:
        """Wait (until ``deadline``, a ``time.monotonic()`` value) for the peers to receive
        ``works``; whether they did."""
        try:
            for w in works:
                left = max(0.001, deadline - time.monotonic())
                if not w.wait(timeout=datetime.timedelta(seconds=left)):
                    return False
        except Exception:  # noqa: BLE001 - timed out, or the peer is gone
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued send has been received (the end of a step: no receive is
        posted, so the step's buffers may serve the next one)."""
        pending, self._pending = self._pending, []
        try:
            with in_collective():
                for w, _ in pending:
                    w.wait()
        except (RuntimeError, dist.DistError) as e:
            self._buffers.drop()
            raise self._fail(e, "send") from e
        self._buffers.end_step()

    def abandon(self) -> None:
        """Stop waiting for the queued sends (after a failure): they are kept, not waited for,
        since gloo drops a send whose work is freed before its peer takes it, and a peer may still
        take them before the error marker that follows them (``runtime._take_marker``)."""
        self._abandoned = [(w, t) for w, t in self._abandoned if not w.is_completed()] + self._pending
        self._pending = []
        self._buffers.drop()
