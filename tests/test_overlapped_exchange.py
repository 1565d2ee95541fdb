"""The deterministic mode's overlapped block exchange against the one-collective exchange it
replaces in fit's pieces: the same bits, and its buckets start during the last piece's backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stratagem.comm import LocalCommunicator
from stratagem.comm.blocks import Grads, OverlappedExchange, exchange_blocks
from stratagem.core.canonical import block_sums, combine


class TwoAlike(LocalCommunicator):
    """Two replicas whose blocks are alike (the second sends what the first does); logs gathers."""

    def __init__(self, log: list[str]) -> None:
        super().__init__("cpu")
        self.world_size = 2
        self.log = log

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.clone(), tensor.clone()]

    def all_gather_async(self, tensor: torch.Tensor, out: list[torch.Tensor]) -> Any:
        self.log.append("gather")
        for o in out:
            o.copy_(tensor)
        return super().all_gather_async(tensor, [torch.empty_like(tensor)])


def test_overlapped_exchange_gives_the_same_bits_and_starts_during_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    params = list(model.parameters())
    log: list[str] = []
    comm = TwoAlike(log)
    for i, q in enumerate(params):
        q.register_post_accumulate_grad_hook(lambda _q, i=i: log.append(f"ready {i}"))
    xs = torch.randn(3, 5, 6)  # this replica's 3 pieces of 5 rows
    ranges, lo, hi, n = [(0, 3), (3, 6)], 0, 3, 6

    def piece(k: int) -> Grads:
        model.zero_grad(set_to_none=True)
        model(xs[k]).square().mean().backward()
        return Grads(q.grad.clone() for q in params)

    pieces = {k: piece(k) for k in range(lo, hi)}
    expected = combine(exchange_blocks(comm, block_sums(pieces, lo, hi, n), ranges, params), n)

    exchange = OverlappedExchange(params, first_cap=64, cap=256)  # several buckets
    assert len(exchange.buckets) >= 3
    earlier = {k: pieces[k] for k in range(lo, hi - 1)}
    log.clear()
    model.zero_grad(set_to_none=True)
    with exchange.during(comm, earlier, lo, hi, n, ranges):
        model(xs[hi - 1]).square().mean().backward()
    got = exchange.finish(ranges)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    # the first bucket's gather started before the first layer's gradient was ready
    assert log.index("gather") < log.index("ready 0")
    assert log.count("gather") == len(exchange.buckets)
