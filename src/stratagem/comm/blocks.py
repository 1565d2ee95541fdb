"""The deterministic mode's exchange: the fixed tree finished slice by slice, at all-reduce cost.

Each replica holds a contiguous range of the global batch's pieces and has summed its aligned
blocks (``core/canonical.py``). The gradients, one flat buffer per dtype (per bucket in fit), are
cut into N equal slices, one per replica. One all-to-all gives each replica every replica's block
sums of its own slice (the unreduced contributions: a reduce-scatter's shape); it finishes the
tree on that slice in the tree's order (``combine`` adds elementwise, so a slice of the root is
the root of the slices, bit for bit); an all-gather of the finished slices gives every replica the
whole root. A replica holding ``k`` blocks sends ``(k + 1)(N - 1)/N`` of the gradient, where a
ring all-reduce sends ``2(N - 1)/N`` (``k`` is 1 when its range is one aligned block: its pieces a
power of two), and keeps ``k + K/N + 1`` gradients' worth of buffers (``K``: every replica's
blocks), whatever N.

``SlicePlan`` is the plan (pure data); ``SlicedTree`` carries out one flat buffer's exchange;
``reduce_blocks`` is the exchange after backward (the custom loop's, ``distribute/engines/
piecewise.py``, and fit's under ``on_failure="continue"``, ``train/pieces.py``);
``OverlappedExchange`` does it in buckets during the last piece's backward pass (fit's pieces),
as the default path's reducer overlaps its all-reduce: each bucket's all-to-all starts as its
block sums are complete, the all-gathers once backward is done. The same operands added in the
same order as on one process: the same bits.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stratagem.comm.buckets import MB, ParamSpec, plan_buckets
from stratagem.comm.communicator import Communicator
from stratagem.core.canonical import Block, block_halves, blocks, combine
from stratagem.core.eager import eager_hooks, eager_only


class Grads(tuple):  # type: ignore[type-arg]
    """One piece's (or block's) gradients, one tensor per parameter; ``+`` adds them parameter by parameter."""

    def __add__(self, other: Any) -> Grads:  # type: ignore[override]
        return Grads(a + b for a, b in zip(self, other))


@dataclass(frozen=True)
class SlicePlan:
    """One flat buffer of ``numel`` elements summed by the tree over ``len(blocks)`` replicas,
    replica ``r`` holding the sums of ``blocks[r]``: replica ``s`` finishes slice ``s``, elements
    ``[s * width, (s + 1) * width)`` (the last one padded)."""

    numel: int
    blocks: tuple[tuple[Block, ...], ...]

    @property
    def world(self) -> int:
        return len(self.blocks)

    @property
    def width(self) -> int:
        return max(1, -(-self.numel // self.world))

    def send_splits(self, rank: int) -> list[int]:
        """Elements replica ``rank`` sends to each replica: its block sums of that one's slice."""
        return [len(self.blocks[rank]) * self.width] * self.world

    def recv_splits(self) -> list[int]:
        """Elements each replica sends to any one: its block sums of that one's slice."""
        return [len(b) * self.width for b in self.blocks]

    def sent(self, rank: int) -> int:
        """Elements replica ``rank`` puts on the wire: the all-to-all's parts for the others, and
        its finished slice once to each of them (a ring all-gather forwards N - 1 slices)."""
        return (self.world - 1) * (len(self.blocks[rank]) + 1) * self.width

    def __str__(self) -> str:
        held = " ".join(str(len(b)) for b in self.blocks)
        return f"{self.numel} = {self.world} x {self.width}, blocks held {held}"


def plan_slices(numel: int, ranges: Sequence[tuple[int, int]]) -> SlicePlan:
    """The plan for ``numel`` elements when replica ``r`` holds pieces ``ranges[r]``."""
    return SlicePlan(numel, tuple(tuple(blocks(lo, hi)) for lo, hi in ranges))


class SlicedTree:
    """One flat buffer's exchange for replica ``rank``: its block sums ``put`` into a send buffer
    laid out by destination (``[replica, block, element of the slice]``), the all-to-all
    (``start`` or ``exchange``), its slice of the root (``finished``), every slice gathered
    (``gathered`` / ``gather_async``). The send and receive buffers are kept for reuse."""

    def __init__(self, plan: SlicePlan, rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.plan, self.rank = plan, rank
        w = plan.width
        self.send = torch.zeros(plan.world, len(plan.blocks[rank]), w, dtype=dtype, device=device)
        self.recv = torch.empty(sum(len(b) for b in plan.blocks) * w, dtype=dtype, device=device)

    def put(self, row: int, offset: int, values: torch.Tensor, plus: torch.Tensor | None = None) -> None:
        """``values`` (flat), or ``values + plus`` added in place, as elements ``offset, ...`` of
        this replica's ``row``-th block sum."""
        w, k, pos = self.plan.width, values.numel(), 0
        while pos < k:
            s, t = divmod(offset + pos, w)
            m = min(w - t, k - pos)
            if plus is None:
                self.send[s, row, t : t + m].copy_(values[pos : pos + m])
            else:
                torch.add(values[pos : pos + m], plus[pos : pos + m], out=self.send[s, row, t : t + m])
            pos += m

    def start(self, comm: Communicator) -> Any:
        plan = self.plan
        return comm.all_to_all_async(self.send, self.recv, plan.send_splits(self.rank), plan.recv_splits())

    def exchange(self, comm: Communicator) -> None:
        plan = self.plan
        comm.all_to_all(self.send, self.recv, plan.send_splits(self.rank), plan.recv_splits())

    def finished(self, n: int) -> torch.Tensor:
        """This replica's slice of the root, once the all-to-all is done: the tree finished over
        every replica's block sums of the slice."""
        rows = iter(self.recv.split(self.plan.width))
        known = {blk: next(rows) for held in self.plan.blocks for blk in held}
        return combine(known, n)

    def gather_async(self, comm: Communicator, mine: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start gathering every replica's finished slice; the root (flat, a new tensor, filled
        once the work is waited for) and the work."""
        out = torch.empty(self.plan.world, self.plan.width, dtype=mine.dtype, device=mine.device)
        work = comm.all_gather_async(mine.contiguous(), list(out.unbind(0)))
        return out.view(-1)[: self.plan.numel], work

    def gathered(self, comm: Communicator, mine: torch.Tensor) -> torch.Tensor:
        """Every replica's finished slice, concatenated: the root (flat, a new tensor)."""
        return torch.cat(comm.all_gather_tensor(mine.contiguous()))[: self.plan.numel]


def reduce_blocks(
    comm: Communicator, mine: dict[Block, Grads], ranges: Sequence[tuple[int, int]], params: Sequence[torch.Tensor], n: int
) -> list[torch.Tensor]:
    """The root of the tree over ``n`` pieces, one tensor per parameter, from this replica's block
    sums ``mine`` (``ranges``: each replica's range of piece indices): one sliced exchange per
    dtype and device of the parameters, after backward."""
    if comm.world_size == 1:
        return list(combine(mine, n))
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for j, q in enumerate(params):
        groups.setdefault((q.dtype, q.device), []).append(j)
    out: list[torch.Tensor] = [torch.empty(0)] * len(params)
    for (dtype, device), idx in groups.items():
        offsets = [0, *itertools.accumulate(params[i].numel() for i in idx)]
        plan = plan_slices(offsets.pop(), ranges)
        tree = SlicedTree(plan, comm.rank, dtype, device)
        for row, blk in enumerate(plan.blocks[comm.rank]):
            for j, off in zip(idx, offsets):
                tree.put(row, off, mine[blk][j].reshape(-1))
        tree.exchange(comm)
        root = tree.gathered(comm, tree.finished(n))
        for j, off in zip(idx, offsets):
            out[j] = root[off : off + params[j].numel()].view_as(params[j])
    return out


def agreed_seed(comm: Communicator) -> int:
    """The chief's ``torch.initial_seed()`` on every replica: the pieces' generators start from
    the same seed on every replica and on one process, as the user seeded it."""
    base = int(torch.initial_seed())
    return int(comm.broadcast_object(base, 0)) if comm.world_size > 1 else base


@contextlib.contextmanager
def generator_at(seed: int, devices: Iterable[torch.device | None] = ()) -> Iterator[None]:
    """torch's generators set to ``seed`` inside (a piece's dropout), restored after: the CPU's
    and those of the CUDA ``devices`` (as ``torch.manual_seed`` sets them; it would also queue a
    seeding of every device not initialized, formatting a stack each time: a cost per piece)."""
    cuda = [d for d in devices if d is not None and d.type == "cuda"]
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for d in cuda:
            with torch.cuda.device(d):
                torch.cuda.manual_seed(seed)
        yield


class OverlappedExchange:
    """The sliced exchange of one update, in buckets started while the last piece's backward
    pass runs: when every parameter of the next bucket (reverse registration order, as the
    reducer plans before it has seen a pass) has the last piece's gradient, that bucket's block
    sums are put in its send buffer and its all-to-all starts; ``finish`` waits for each in turn,
    finishes this replica's slice of it, starts its all-gather, and hands back the roots. Only for
    parameters of one dtype on one device (``supports``)."""

    def __init__(self, params: Sequence[torch.Tensor], first_cap: int = MB, cap: int = 25 * MB) -> None:
        self.params = list(params)
        specs = [ParamSpec(str(i), q.numel(), q.element_size(), str(q.dtype), str(q.device)) for i, q in enumerate(self.params)]
        self.buckets = plan_buckets(specs, first_cap, cap)
        self._bucket_of = {i: b.index for b in self.buckets for i in b.params}
        # each bucket's exchange, for (ranges, rank): its buffers kept between updates
        self._key: tuple[tuple[tuple[int, int], ...], int] | None = None
        self._trees: list[SlicedTree] = []
        self._works: list[tuple[Any, Any]] = []
        self._state: Any = None

    @staticmethod
    def supports(params: Sequence[torch.Tensor]) -> bool:
        return bool(params) and len({(q.dtype, q.device) for q in params}) == 1 and not any(hasattr(q, "to_local") for q in params)

    def _trees_for(self, ranges: Sequence[tuple[int, int]], rank: int) -> list[SlicedTree]:
        key = (tuple(ranges), rank)
        if self._key != key:
            q0 = self.params[0]
            self._trees = [SlicedTree(plan_slices(b.numel, ranges), rank, q0.dtype, q0.device) for b in self.buckets]
            self._key = key
        return self._trees

    @contextlib.contextmanager
    def during(
        self, comm: Communicator, pieces: dict[int, Grads], lo: int, hi: int, n: int, ranges: Sequence[tuple[int, int]]
    ) -> Iterator[None]:
        """While the last piece ``hi - 1`` of this replica's ``[lo, hi)`` runs (``pieces``: the
        earlier ones' gradients)."""
        self._state = _Pass(comm, self._trees_for(ranges, comm.rank), pieces, lo, hi, n, len(self.buckets))
        self._works = []
        handles = [q.register_post_accumulate_grad_hook(self._hook(j)) for j, q in enumerate(self.params) if q.requires_grad]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        st = self._state
        while st.next < len(self.buckets):  # parameters the last piece gave no gradient: zeros
            self._launch(self.buckets[st.next])

    def _hook(self, j: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            self._ready(j, param)

        return hook

    def _ready(self, j: int, param: torch.Tensor) -> None:
        st = self._state
        if st is None or j in st.got:
            return
        st.got[j] = param.grad
        st.ready[self._bucket_of[j]] += 1
        while st.next < len(self.buckets) and st.ready[st.next] == len(self.buckets[st.next].params):
            self._launch(self.buckets[st.next])

    def _launch(self, b: Any) -> None:
        st = self._state
        tree = st.trees[b.index]
        mine = blocks(st.lo, st.hi)
        for j, off in zip(b.params, b.offsets):
            q = self.params[j]
            last = st.got.get(j)
            vals = {k: st.pieces[k][j] for k in range(st.lo, st.hi - 1)}
            vals[st.hi - 1] = torch.zeros_like(q) if last is None else last
            # the pieces' gradients are this update's own: the nodes below a block are added in
            # place, and each block's last addition goes into the send buffer
            halves = block_halves(vals, st.lo, st.hi, st.n, torch.Tensor.add_)
            for row, blk in enumerate(mine):
                left, right = halves[blk]
                tree.put(row, off, left.reshape(-1), None if right is None else right.reshape(-1))
        self._works.append((b, tree.start(st.comm)))
        st.next += 1

    def finish(self) -> list[torch.Tensor]:
        """Every parameter's root of the tree (waits for the buckets started)."""
        st, self._state = self._state, None
        works, self._works = self._works, []
        gathers = []
        for b, work in works:  # in the order started, alike on every replica
            work.wait()
            tree = st.trees[b.index]
            gathers.append((b, *tree.gather_async(st.comm, tree.finished(st.n))))
        out: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        for b, root, work in gathers:
            work.wait()
            for j, off in zip(b.params, b.offsets):
                q = self.params[j]
                out[j] = root[off : off + q.numel()].view_as(q)
        return out


class _Pass:
    """One update's overlapped exchange in progress."""

    def __init__(self, comm: Communicator, trees: list[SlicedTree], pieces: dict[int, Grads], lo: int, hi: int, n: int, nbuckets: int) -> None:
        self.comm, self.trees, self.pieces = comm, trees, pieces
        self.lo, self.hi, self.n = lo, hi, n
        self.got: dict[int, torch.Tensor | None] = {}
        self.ready = [0] * nbuckets
        self.next = 0


eager_only(OverlappedExchange, ["_ready", "finish"])
eager_hooks(OverlappedExchange, ["_hook"])
