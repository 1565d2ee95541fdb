"""The deterministic mode's exchange: every replica's block sums of the fixed tree, gathered.

Each replica holds a contiguous range of the global batch's pieces and has summed its aligned
blocks (``core/canonical.py``); the ranges are known everywhere, so the blocks travel as one
tensor per replica (padded to the most blocks any replica holds) in one all-gather, and every
replica finishes the tree alike. Shared by fit's pieces (``train/pieces.py``) and the custom
loop's (``distribute/engines/piecewise.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from stratagem.comm.communicator import Communicator
from stratagem.core.canonical import Block, blocks


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
