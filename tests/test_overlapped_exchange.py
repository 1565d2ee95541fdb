"""The deterministic mode's sliced exchange (``comm/blocks.py``): every replica ends with one
process's root of the tree, bit for bit, for any replica count and split of the pieces; it sends
no more than 1.25x a ring all-reduce's bytes and keeps O(P) buffers; fit's overlapped form starts
its buckets during the last piece's backward. Replicas are threads over an in-process wire (no
process group); ``tests/test_sliced_exchange_gloo.py`` runs the same exchange on gloo."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from stratagem.comm import LocalCommunicator
from stratagem.comm.blocks import Grads, OverlappedExchange, SlicedTree, plan_slices, reduce_blocks
from stratagem.core.canonical import block_sums, combine


class _Done:
    def wait(self) -> bool:
        return True


class Wire:
    """What the replicas of one in-process group put on the wire, swapped at a barrier."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[Any] = [None] * world

    def swap(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got


class ThreadComm(LocalCommunicator):
    """One replica of a group of threads: collectives complete when every replica has called;
    counts the elements it sends (a ring all-gather forwards N - 1 parts, a ring all-reduce
    sends 2(N - 1)/N of its tensor) and logs the collectives it starts."""

    def __init__(self, wire: Wire, rank: int, log: list[str] | None = None) -> None:
        super().__init__("cpu")
        self.wire, self.rank, self.world_size = wire, rank, wire.world
        self.sent = 0
        self.log = log if log is not None else []

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, send_splits: Any, recv_splits: Any) -> None:
        self.log.append("all_to_all")
        parts = [p.clone() for p in send.reshape(-1).split(list(send_splits))]
        got = self.wire.swap(self.rank, parts)
        assert [g[self.rank].numel() for g in got] == list(recv_splits)
        recv.view(-1).copy_(torch.cat([g[self.rank] for g in got]))
        self.sent += sum(send_splits) - send_splits[self.rank]

    def all_to_all_async(self, send: torch.Tensor, recv: torch.Tensor, send_splits: Any, recv_splits: Any) -> Any:
        self.all_to_all(send, recv, send_splits, recv_splits)
        return _Done()

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.sent += (self.world_size - 1) * tensor.numel()
        return [g.clone() for g in self.wire.swap(self.rank, tensor.clone())]

    def all_gather_async(self, tensor: torch.Tensor, out: list[torch.Tensor]) -> Any:
        self.log.append("all_gather")
        for o, g in zip(out, self.all_gather_tensor(tensor)):
            o.copy_(g)
        return _Done()

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> None:
        self.sent += 2 * (self.world_size - 1) * tensor.numel() // self.world_size
        total = torch.stack(self.wire.swap(self.rank, tensor.clone())).sum(0)
        tensor.copy_(total)


def on_threads(world: int, fn: Callable[[ThreadComm], Any]) -> list[Any]:
    """``fn(comm)`` on ``world`` threads forming one group; their results by rank."""
    wire = Wire(world)
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(ThreadComm(wire, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            wire.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def _pieces(n: int, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> dict[int, Grads]:
    """Gradients of ``n`` pieces whose sums depend on the order they are added in (magnitudes
    spread over many decades)."""
    g = torch.Generator().manual_seed(n)
    return {
        k: Grads((torch.randn(s, generator=g) * 10.0 ** torch.randint(-6, 7, s, generator=g)).to(d) for s, d in zip(shapes, dtypes))
        for k in range(n)
    }  # fmt: skip


def _one_process(pieces: dict[int, Grads], n: int) -> Grads:
    return combine(block_sums(pieces, 0, n, n), n)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("n", [4, 7, 12, 16])
@pytest.mark.parametrize("split", ["even", "uneven"])
def test_every_replica_ends_with_one_process_root_bit_for_bit(world, n, split):
    if split == "even" and n % world:
        pytest.skip("an even split needs a multiple of the replicas")
    shapes, dtypes = [(5, 3), (7,), (1,), (4, 2, 3)], [torch.float32] * 4
    if split == "uneven":  # as under on_failure="continue", and mixed dtypes: one exchange each
        dtypes = [torch.float32, torch.float64, torch.float32, torch.float64]
    pieces, params = _pieces(n, shapes, dtypes), [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]
    ranges = [(r * n // world, (r + 1) * n // world) for r in range(world)]
    want = _one_process(pieces, n)
    assert not torch.equal(want[0], sum(pieces[k][0] for k in range(n)))  # the order shows in the bits

    def replica(comm: ThreadComm) -> list[torch.Tensor]:
        lo, hi = ranges[comm.rank]
        return reduce_blocks(comm, block_sums(pieces, lo, hi, n), ranges, params, n)

    for got in on_threads(world, replica):
        assert all(torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape for a, b in zip(got, want))


def test_bytes_per_replica_stay_within_125_percent_of_a_ring_all_reduce_at_any_n():
    """Each replica's range one aligned block (its pieces a power of two): it sends 2(N - 1)/N of
    the gradient plus at most N - 1 elements of padding, like a ring all-reduce, at any N; its
    buffers hold about 2 gradients' worth whatever N (memory O(P))."""
    p = 1_000_003
    for world in [2, 3, 4, 8, 16, 64, 256, 1024, 4096]:
        n = 4 * world
        plan = plan_slices(p, [(r * 4, (r + 1) * 4) for r in range(world)])
        ring = 2 * (world - 1) * p / world
        for rank in {0, world - 1}:
            assert plan.sent(rank) <= 1.25 * ring, (world, str(plan))
            assert plan.sent(rank) <= ring + 2 * world
        buffers = len(plan.blocks[0]) * world * plan.width + sum(len(b) for b in plan.blocks) * plan.width
        assert buffers <= 2 * p + 2 * world, world
        assert n == plan.blocks[-1][-1][1]
    # what the replicas count on the wire is what the plan says, and within the bound
    world, n, shapes = 4, 16, [(300, 7), (11,)]
    pieces, params = _pieces(n, shapes, [torch.float32] * 2), [torch.empty(s) for s in shapes]
    ranges = [(r * 4, (r + 1) * 4) for r in range(world)]

    def replica(comm: ThreadComm) -> tuple[int, int]:
        lo, hi = ranges[comm.rank]
        reduce_blocks(comm, block_sums(pieces, lo, hi, n), ranges, params, n)
        sliced, comm.sent = comm.sent, 0
        comm.all_reduce([torch.zeros(s) for s in shapes], check=False)  # the default mode's
        return sliced, comm.sent

    plan = plan_slices(300 * 7 + 11, ranges)
    for rank, (sliced, ring) in enumerate(on_threads(world, replica)):
        assert sliced == plan.sent(rank)
        assert sliced <= 1.25 * ring


def test_a_plan_prints_compactly():
    assert str(plan_slices(10, [(0, 2), (2, 3), (3, 6)])) == "10 = 3 x 4, blocks held 1 1 2"
    assert plan_slices(10, [(0, 2), (2, 3), (3, 6)]).recv_splits() == [4, 4, 8]
    assert plan_slices(0, [(0, 1), (1, 2)]).width == 1


def test_put_lays_a_parameter_across_the_slices_it_spans():
    plan = plan_slices(10, [(0, 2), (2, 4), (4, 6)])
    tree = SlicedTree(plan, 1, torch.float32, torch.device("cpu"))
    tree.put(0, 2, torch.arange(1.0, 8.0))  # elements 2..8 of a 3 x 4 layout
    assert tree.send.reshape(3, 4).tolist() == [[0, 0, 1, 2], [3, 4, 5, 6], [7, 0, 0, 0]]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_overlapped_exchange_gives_the_same_bits_and_starts_during_backward(world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    local = 5  # blocks of 4 and 1 pieces: the 4's lower nodes added in place into the pieces' gradients
    n = local * world
    xs = torch.randn(n, 5, 6)  # the global batch's pieces of 5 rows
    ranges = [(r * local, (r + 1) * local) for r in range(world)]

    def grads_of(net: nn.Module, k: int) -> Grads:
        net.zero_grad(set_to_none=True)
        net(xs[k]).square().mean().backward()
        return Grads(q.grad.clone() for q in net.parameters())

    want = _one_process({k: grads_of(model, k) for k in range(n)}, n)
    replicas = [copy.deepcopy(model) for _ in range(world)]

    def replica(comm: ThreadComm) -> tuple[list[torch.Tensor], list[str], int]:
        net = replicas[comm.rank]
        params = list(net.parameters())
        for i, q in enumerate(params):
            q.register_post_accumulate_grad_hook(lambda _q, i=i: comm.log.append(f"ready {i}"))
        lo, hi = ranges[comm.rank]
        earlier = {k: grads_of(net, k) for k in range(lo, hi - 1)}
        exchange = OverlappedExchange(params, first_cap=64, cap=256)  # several buckets
        net.zero_grad(set_to_none=True)
        for _ in range(2):  # the buffers kept for the next update give the same bits again
            comm.log.clear()
            pieces = {k: Grads(t.clone() for t in g) for k, g in earlier.items()}  # each update's own
            with exchange.during(comm, pieces, lo, hi, n, ranges):
                net(xs[hi - 1]).square().mean().backward()
            got = exchange.finish()
            net.zero_grad(set_to_none=True)
        return got, list(comm.log), len(exchange.buckets)

    for got, log, buckets in on_threads(world, replica):
        assert buckets >= 3
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        # the first bucket's all-to-all started before the first layer's gradient was ready
        assert log.index("all_to_all") < log.index("ready 0")
        assert log.count("all_to_all") == log.count("all_gather") == buckets
        assert log.index("all_gather") > log.index("ready 0")


def test_block_halves_add_up_to_the_block_sums():
    from stratagem.core.canonical import block_halves

    pieces = {k: torch.tensor([float(10**k)]) for k in range(3, 11)}
    halves = block_halves(pieces, 3, 11, 12)
    assert list(halves) == [(3, 4), (4, 8), (8, 10), (10, 11)]
    assert halves[(3, 4)] == (pieces[3], None)
    for blk, (left, right) in halves.items():
        assert torch.equal(left if right is None else left + right, block_sums(pieces, 3, 11, 12)[blk])
