"""The deterministic mode's exchange: every replica's block sums of the fixed tree, gathered.

Each replica holds a contiguous range of the global batch's pieces and has summed its aligned
blocks (``core/canonical.py``); the ranges are known everywhere, so the blocks travel as one
tensor per replica (padded to the most blocks any replica holds) in one all-gather, and every
replica finishes the tree alike. Shared by fit's pieces (``train/pieces.py``) and the custom
loop's (``distribute/engines/piecewise.py``). ``OverlappedExchange`` does the same in buckets
during the last piece's backward pass (fit's pieces), as the default path's reducer overlaps its
all-reduce: the same operands added in the same order, so the same bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from stratagem.comm.buckets import MB, ParamSpec, plan_buckets
from stratagem.comm.communicator import Communicator
from stratagem.core.canonical import Block, block_sums, blocks, combine
from stratagem.core.eager import eager_hooks, eager_only


class Grads(tuple):  # type: ignore[type-arg]
    """One piece's (or block's) gradients, one tensor per parameter; ``+`` adds them parameter by parameter."""

    def __add__(self, other: Any) -> Grads:  # type: ignore[override]
        return Grads(a + b for a, b in zip(self, other))


def exchange_blocks(
    comm: Communicator, mine: dict[Block, Grads], ranges: Sequence[tuple[int, int]], params: Sequence[torch.Tensor]
) -> dict[Block, Grads]:
    """Every replica's block sums (``ranges``: each replica's range of piece indices)."""
    if comm.world_size == 1:
        return mine
    if len({q.dtype for q in params}) != 1:  # mixed dtypes: as objects
        known: dict[Block, Grads] = {}
        for theirs in comm.all_gather_object({b: Grads(t.cpu() for t in g) for b, g in mine.items()}):
            known.update({b: Grads(t.to(q.device) for t, q in zip(g, params)) for b, g in theirs.items()})
        return known
    every = [blocks(lo, hi) for lo, hi in ranges]
    rows = max(max(len(b) for b in every), 1)
    flat = [torch.cat([t.reshape(-1) for t in mine[b]]) for b in sorted(mine)]
    pad = torch.zeros(sum(q.numel() for q in params), dtype=params[0].dtype, device=params[0].device)
    packed = torch.stack(flat + [pad] * (rows - len(flat)))
    sizes = [q.numel() for q in params]
    known = {}
    for theirs, held in zip(comm.all_gather_tensor(packed), every):
        for row, b in zip(theirs, held):
            known[b] = Grads(t.view_as(q) for t, q in zip(row.split(sizes), params))
    return known


def agreed_seed(comm: Communicator) -> int:
    """The chief's ``torch.initial_seed()`` on every replica: the pieces' generators start from
    the same seed on every replica and on one process, as the user seeded it."""
    base = int(torch.initial_seed())
    return int(comm.broadcast_object(base, 0)) if comm.world_size > 1 else base


@contextlib.contextmanager
def generator_at(seed: int, devices: Iterable[torch.device | None] = ()) -> Iterator[None]:
    """torch's generators set to ``seed`` inside (a piece's dropout), restored after."""
    cuda = [d for d in devices if d is not None and d.type == "cuda"]
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield


class OverlappedExchange:
    """The block exchange of one update, in buckets started while the last piece's backward
    pass runs: when every parameter of the next bucket (reverse registration order, as the
    reducer plans before it has seen a pass) has the last piece's gradient, that bucket's block
    sums are packed and their all-gather starts; ``finish`` waits and finishes the tree per
    parameter. Only for parameters of one dtype on one device (``supports``)."""

    def __init__(self, params: Sequence[torch.Tensor], first_cap: int = MB, cap: int = 25 * MB) -> None:
        self.params = list(params)
        specs = [ParamSpec(str(i), q.numel(), q.element_size(), str(q.dtype), str(q.device)) for i, q in enumerate(self.params)]
        self.buckets = plan_buckets(specs, first_cap, cap)
        self._bucket_of = {i: b.index for b in self.buckets for i in b.params}
        # each bucket's send buffer and receive buffers, for (rows, replicas): kept between updates
        self._shape: tuple[int, int] | None = None
        self._buffers: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self._works: list[tuple[Any, Any]] = []
        self._state: Any = None

    @staticmethod
    def supports(params: Sequence[torch.Tensor]) -> bool:
        return bool(params) and len({(q.dtype, q.device) for q in params}) == 1 and not any(hasattr(q, "to_local") for q in params)

    def _buffers_for(self, rows: int, world: int) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        if self._shape != (rows, world):
            q0 = self.params[0]
            self._buffers = [
                (torch.zeros(rows, b.numel, dtype=q0.dtype, device=q0.device),
                 [torch.empty(rows, b.numel, dtype=q0.dtype, device=q0.device) for _ in range(world)])
                for b in self.buckets
            ]  # fmt: skip
            self._shape = (rows, world)
        return self._buffers

    @contextlib.contextmanager
    def during(
        self, comm: Communicator, pieces: dict[int, Grads], lo: int, hi: int, n: int, ranges: Sequence[tuple[int, int]]
    ) -> Iterator[None]:
        """While the last piece ``hi - 1`` of this replica's ``[lo, hi)`` runs (``pieces``: the
        earlier ones' gradients)."""
        rows = max(max(len(blocks(a, b)) for a, b in ranges), 1)
        self._state = _Pass(comm, self._buffers_for(rows, comm.world_size), pieces, lo, hi, n, len(self.buckets))
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
        send, recv = st.buffers[b.index]
        mine = blocks(st.lo, st.hi)
        for j, off in zip(b.params, b.offsets):
            q = self.params[j]
            last = st.got.get(j)
            vals = {k: st.pieces[k][j] for k in range(st.lo, st.hi - 1)}
            vals[st.hi - 1] = torch.zeros_like(q) if last is None else last
            sums = block_sums(vals, st.lo, st.hi, st.n)
            for r, blk in enumerate(mine):
                send[r, off : off + q.numel()].copy_(sums[blk].reshape(-1))
        self._works.append((b, st.comm.all_gather_async(send, recv)))
        st.next += 1

    def finish(self, ranges: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Every parameter's root of the tree (waits for the buckets started)."""
        st, self._state = self._state, None
        every = [blocks(a, b) for a, b in ranges]
        out: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        works, self._works = self._works, []
        for b, work in works:
            work.wait()
            _, recv = st.buffers[b.index]
            for j, off in zip(b.params, b.offsets):
                q = self.params[j]
                known = {blk: theirs[r, off : off + q.numel()].view_as(q)
                         for theirs, held in zip(recv, every) for r, blk in enumerate(held)}  # fmt: skip
                root = combine(known, st.n)
                out[j] = root.clone() if any(root is v for v in known.values()) else root
        return out


class _Pass:
    """One update's overlapped exchange in progress."""

    def __init__(self, comm: Communicator, buffers: Any, pieces: dict[int, Grads], lo: int, hi: int, n: int, nbuckets: int) -> None:
        self.comm, self.buffers, self.pieces = comm, buffers, pieces
        self.lo, self.hi, self.n = lo, hi, n
        self.got: dict[int, torch.Tensor | None] = {}
        self.ready = [0] * nbuckets
        self.next = 0


eager_only(OverlappedExchange, ["_ready", "finish"])
eager_hooks(OverlappedExchange, ["_hook"])
