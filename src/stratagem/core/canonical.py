"""One fixed summation tree over piece indices: the same bits for every split of the pieces.

The deterministic mode (docs/design/DETERMINISM.md) cuts each global batch into ``n`` pieces and
sums their gradients in one binary tree over piece indices, whatever the number of replicas: node
``[lo, hi)`` is an aligned power-of-two block (``lo`` a multiple of ``hi - lo``), the sum of its two
halves, left + right; a half wholly past ``n`` is empty and the node is its other half. A replica
holding pieces ``[a, b)`` sums the largest aligned blocks inside its range (``blocks``,
``block_sums``), following the tree; once every replica's blocks are known, ``combine`` finishes
the tree. Floating-point addition of the same operands in the same order gives the same bits, so
every node, and the root, is the same for every split of ``[0, n)``.

Pure: it adds whatever supports ``+`` (tensors, floats) and imports nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")

Block = tuple[int, int]


def _root(n: int) -> Block:
    return 0, 1 << max(0, n - 1).bit_length()


def blocks(lo: int, hi: int) -> list[Block]:
    """The largest aligned blocks that cover ``[lo, hi)`` exactly, left to right: each
    ``[i * 2**h, (i + 1) * 2**h)`` is a node of the tree."""
    if not 0 <= lo <= hi:
        raise ValueError(f"blocks: need 0 <= lo <= hi, got [{lo}, {hi})")
    out = []
    while lo < hi:
        size = lo & -lo if lo else 1 << (hi - lo).bit_length()
        while size > hi - lo:
            size >>= 1
        out.append((lo, lo + size))
        lo += size
    return out


def _node(lo: int, hi: int, n: int, known: Mapping[Block, Any]) -> Any:
    """The value of node ``[lo, hi)`` from ``known`` values of nodes (pieces are ``[i, i + 1)``);
    None when the node lies wholly past ``n``."""
    if lo >= n:
        return None
    if (lo, hi) in known:
        return known[(lo, hi)]
    if hi - lo == 1:
        raise KeyError(f"piece {lo} of {n} is in no known block")
    mid = (lo + hi) // 2
    left, right = _node(lo, mid, n, known), _node(mid, hi, n, known)
    return left if right is None else left + right


def block_sums(pieces: Mapping[int, T], lo: int, hi: int, n: int) -> dict[Block, T]:
    """The sums of ``blocks(lo, hi)`` from the values of pieces ``lo .. hi - 1`` (each summed by
    the tree's order), to send to the other replicas."""
    if hi > n:
        raise ValueError(f"block_sums: pieces [{lo}, {hi}) run past n = {n}")
    known = {(i, i + 1): pieces[i] for i in range(lo, hi)}
    return {b: _node(b[0], b[1], n, known) for b in blocks(lo, hi)}


def combine(known: Mapping[Block, T], n: int) -> T:
    """The root: the sum of all ``n`` pieces by the tree, from blocks (every replica's
    ``block_sums``, gathered) that together cover ``[0, n)``."""
    if n < 1:
        raise ValueError(f"combine: need at least one piece, got n = {n}")
    lo, hi = _root(n)
    return _node(lo, hi, n, known)  # type: ignore[no-any-return]
