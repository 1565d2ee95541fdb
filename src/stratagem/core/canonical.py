"""One fixed summation tree over piece indices: the same bits for every split of the pieces.

The deterministic mode (docs/design/DETERMINISM.md) cuts each global batch into ``n`` pieces and
sums their gradients in one binary tree over piece indices, whatever the number of replicas: node
``[lo, hi)`` is an aligned power-of-two block (``lo`` a multiple of ``hi - lo``), the sum of its two
halves, left + right; a half wholly past ``n`` is empty and the node is its other half. A replica
holding pieces ``[a, b)`` sums the largest aligned blocks inside its range (``blocks``,
``block_sums``), following the tree; once every replica's blocks are known, ``combine`` finishes
the tree. Floating-point addition of the same operands in the same order gives the same bits, so
every node, and the root, is the same for every split of ``[0, n)``.

Pure: it adds whatever supports ``+`` (tensors, floats), or what a caller's ``add`` adds, and
imports nothing from the package.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
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


def _node(lo: int, hi: int, n: int, known: Mapping[Block, Any], add: Callable[[Any, Any], Any] = operator.add) -> Any:
    """The value of node ``[lo, hi)`` from ``known`` values of nodes (pieces are ``[i, i + 1)``);
    None when the node lies wholly past ``n``."""
    if lo >= n:
        return None
    if (lo, hi) in known:
        return known[(lo, hi)]
    if hi - lo == 1:
        raise KeyError(f"piece {lo} of {n} is in no known block")
    mid = (lo + hi) // 2
    left, right = _node(lo, mid, n, known, add), _node(mid, hi, n, known, add)
    return left if right is None else add(left, right)


def block_sums(pieces: Mapping[int, T], lo: int, hi: int, n: int) -> dict[Block, T]:
    """The sums of ``blocks(lo, hi)`` from the values of pieces ``lo .. hi - 1`` (each summed by
    the tree's order), to send to the other replicas."""
    return {b: left if right is None else left + right for b, (left, right) in block_halves(pieces, lo, hi, n).items()}  # type: ignore[operator]


def block_halves(
    pieces: Mapping[int, T], lo: int, hi: int, n: int, add: Callable[[T, T], T] = operator.add
) -> dict[Block, tuple[T, T | None]]:
    """For each of ``blocks(lo, hi)``, the values of its two halves, left and right, whose sum
    (left + right) is the block's; a block of one piece is that piece's value and None. For a
    caller that adds the last two operands where it wants the sum (``comm/blocks.py``: into its
    send buffer). ``add(left, right)`` makes the nodes below (an in-place add into the left
    operand, for a caller that owns the pieces' values: the same sums)."""
    if hi > n:
        raise ValueError(f"block_sums: pieces [{lo}, {hi}) run past n = {n}")
    known = {(i, i + 1): pieces[i] for i in range(lo, hi)}
    out: dict[Block, tuple[T, T | None]] = {}
    for a, b in blocks(lo, hi):
        if b - a == 1:
            out[(a, b)] = (pieces[a], None)
        else:  # a block inside [lo, hi) lies before n: both halves hold pieces
            mid = (a + b) // 2
            out[(a, b)] = (_node(a, mid, n, known, add), _node(mid, b, n, known, add))
    return out


def combine(known: Mapping[Block, T], n: int) -> T:
    """The root: the sum of all ``n`` pieces by the tree, from blocks (every replica's
    ``block_sums``, gathered) that together cover ``[0, n)``."""
    if n < 1:
        raise ValueError(f"combine: need at least one piece, got n = {n}")
    lo, hi = _root(n)
    return _node(lo, hi, n, known)  # type: ignore[no-any-return]
