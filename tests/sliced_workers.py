"""Workers for test_sliced_exchange_gloo.py: the sliced exchange on a real process group."""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn

from stratagem.comm import ProcessGroupCommunicator
from stratagem.comm.blocks import Grads, OverlappedExchange, reduce_blocks
from stratagem.core.canonical import block_sums, combine


def _digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(t.detach().contiguous().cpu().numpy().tobytes() for t in tensors)).hexdigest()


def sliced_roots(n: int, backend: str = "gloo") -> dict[str, str]:
    """The roots every replica ends with, against one process's, as SHA-256s: the exchange after
    backward over an uneven split with two dtypes, and fit's overlapped one over an even split."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        comm = ProcessGroupCommunicator(dist.group.WORLD, device)
        g = torch.Generator().manual_seed(3)
        shapes, dtypes = [(33, 5), (7,), (129,)], [torch.float32, torch.float64, torch.float32]
        pieces = {k: Grads((torch.randn(s, generator=g) * 10.0 ** torch.randint(-6, 7, s, generator=g)).to(d).to(device)
                           for s, d in zip(shapes, dtypes)) for k in range(n)}  # fmt: skip
        params = [torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, dtypes)]
        ranges = [(r * n // world, (r + 1) * n // world) for r in range(world)]
        lo, hi = ranges[rank]
        out = {"one": _digest(list(combine(block_sums(pieces, 0, n, n), n))),
               "sliced": _digest(reduce_blocks(comm, block_sums(pieces, lo, hi, n), ranges, params, n))}  # fmt: skip

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3)).to(device)
        local = 2
        xs = torch.randn(local * world, 5, 6, generator=g).to(device)
        ranges = [(r * local, (r + 1) * local) for r in range(world)]
        lo, hi = ranges[rank]

        def piece(k: int) -> Grads:
            model.zero_grad(set_to_none=True)
            model(xs[k]).square().mean().backward()
            return Grads(q.grad.clone() for q in model.parameters())

        every = {k: piece(k) for k in range(local * world)}
        out["one_model"] = _digest(list(combine(block_sums(every, 0, local * world, local * world), local * world)))
        exchange = OverlappedExchange(list(model.parameters()), first_cap=1024, cap=8192)
        model.zero_grad(set_to_none=True)
        with exchange.during(comm, {k: every[k] for k in range(lo, hi - 1)}, lo, hi, local * world, ranges):
            model(xs[hi - 1]).square().mean().backward()
        out["overlapped"] = _digest(exchange.finish())
        out["buckets"] = str(len(exchange.buckets))
        return out
    finally:
        dist.destroy_process_group()
