"""The fixed summation tree of the deterministic mode: the same bits for every split of the pieces."""

from __future__ import annotations

import itertools

import pytest
import torch

from stratagem.core.canonical import block_sums, blocks, combine


def test_blocks_are_aligned_and_cover_the_range():
    assert blocks(0, 8) == [(0, 8)]
    assert blocks(0, 6) == [(0, 4), (4, 6)]
    assert blocks(3, 11) == [(3, 4), (4, 8), (8, 10), (10, 11)]
    assert blocks(5, 5) == []
    for lo, hi in itertools.combinations(range(40), 2):
        got = blocks(lo, hi)
        assert [b for _, b in got][-1] == hi and got[0][0] == lo
        assert all(a == prev for (a, _), (_, prev) in zip(got[1:], got))  # contiguous
        assert all((b - a) & (b - a - 1) == 0 and a % (b - a) == 0 for a, b in got)  # aligned powers of 2
    with pytest.raises(ValueError, match=r"need 0 <= lo <= hi, got \[4, 2\)"):
        blocks(4, 2)


def _pieces(n: int, seed: int) -> dict[int, torch.Tensor]:
    """float32 gradients of very different magnitudes: a sum's bits depend on its order."""
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(257, generator=g) * 10.0 ** torch.randint(-4, 5, (257,), generator=g) for i in range(n)}


def _splits(n: int, parts: int) -> list[list[tuple[int, int]]]:
    """Every way to cut [0, n) into ``parts`` contiguous ranges (some empty), at most 40 of them."""
    out = []
    for cuts in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        edges = [0, *cuts, n]
        out.append(list(zip(edges, edges[1:])))
        if len(out) == 40:
            break
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12, 17])
def test_the_root_has_the_same_bits_for_every_split(n):
    pieces = _pieces(n, seed=n)
    whole = combine(block_sums(pieces, 0, n, n), n)
    for parts in (2, 3, 5):
        for split in _splits(n, parts):
            known = {}
            for lo, hi in split:  # each replica sums its own blocks; then they are gathered
                known.update(block_sums(pieces, lo, hi, n))
            got = combine(known, n)
            assert torch.equal(got, whole), (n, split)
    torch.testing.assert_close(whole, sum(pieces.values()), rtol=1e-5, atol=1e-2)


def test_the_order_matters_for_these_values_so_the_test_can_fail():
    """The sequential sums of the same pieces differ in their bits: without the fixed tree, two
    splits would not agree (the invariance above is not an accident of the data)."""
    pieces = _pieces(12, seed=12)
    forward = sum(pieces[i] for i in range(12))
    backward = sum(pieces[i] for i in reversed(range(12)))
    assert not torch.equal(forward, backward)


def test_missing_pieces_and_bad_ranges_are_named():
    pieces = _pieces(4, seed=0)
    with pytest.raises(KeyError, match="piece 3 of 4 is in no known block"):
        combine(block_sums(pieces, 0, 3, 4), 4)
    with pytest.raises(ValueError, match=r"pieces \[2, 6\) run past n = 4"):
        block_sums(pieces, 2, 6, 4)
    with pytest.raises(ValueError, match="at least one piece"):
        combine({}, 0)
