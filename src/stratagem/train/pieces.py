"""fit's step in the deterministic mode: the replica's batch in pieces, summed by one fixed tree.

Each ``piece_size``-row piece of a replica's batch runs forward and backward alone (the gradient
reducer off, its random numbers from a generator set by the update and the piece's index in the
global batch), its gradient is taken, and the pieces of the whole global batch are summed in
``core/canonical.py``'s tree: this replica's blocks locally, then every replica's blocks gathered
and the tree finished alike everywhere. The result has the same bits on one process and on any
number of replicas (docs/design/DETERMINISM.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.comm.blocks import Grads, exchange_blocks, generator_at
from stratagem.core.batches import batch_size_of, slice_batch, split_sizes
from stratagem.core.canonical import Block, block_sums, combine
from stratagem.distribute import current
from stratagem.distribute.determinism import OpDeterminism
from stratagem.distribute.strategy import Execution, StateLayout, Strategy

MicroStep = Callable[[Any, Any, Any, "int | None"], None]


def _seed(base: int, update: int, piece: int) -> int:
    return (base * 1_000_003 + update * 65_537 + piece) % (2**63 - 1)


class PieceRunner:
    """One optimizer update's gradients, computed in pieces and summed by the fixed tree."""

    def __init__(
        self, strategy: Strategy, model: Any, params: Sequence[torch.Tensor], mode: OpDeterminism | None
    ) -> None:
        ext = strategy.extended
        if ext.execution is not Execution.REPLICAS or ext.state_layout is not StateLayout.MIRRORED:
            raise ValueError(
                f"enable_op_determinism covers fit under MirroredStrategy, MultiWorkerMirroredStrategy "
                f"and one process; {type(strategy).__name__} shards or pipelines the model: call "
                "stratagem.experimental.disable_op_determinism() to train under it"
            )
        self.strategy = strategy
        #: BatchNorm layers, refused while in training mode (looked up once, checked every step)
        self._batch_norms = [
            (name or "the model", m) for name, m in (model.named_modules() if isinstance(model, nn.Module) else ())
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]  # fmt: skip
        self.params = list(params)
        #: rows per piece; None (``on_failure="continue"`` without the deterministic mode): one
        #: piece per replica, its share of the global batch, random numbers as drawn
        self.piece = mode.piece_size if mode is not None else None
        #: optimizer updates whose gradient every replica has (the exchange and ``commit`` done)
        self.updates = 0
        self._base: int | None = None

    def _check_model(self) -> None:
        for name, m in self._batch_norms:
            if m.training:
                raise ValueError(
                    f"enable_op_determinism: {name} is {type(m).__name__} in training mode, whose "
                    "statistics are over a batch, not a piece: the bits would depend on the replica count. "
                    "Use GroupNorm or LayerNorm, freeze it (eval()), or disable_op_determinism()"
                )

    def _agreed_base(self) -> int:
        """The chief's ``torch.initial_seed()``: the pieces' generators start from the same seed on
        every replica and on one process, as the user seeded it."""
        if self._base is None:
            base = int(torch.initial_seed())
            world = self.strategy.extended.world
            self._base = int(world.broadcast_object(base, 0)) if world.world_size > 1 else base
        return self._base

    def step(self, x: Any, y: Any, sw: Any, total: int | None, micro_step: MicroStep) -> None:
        """Leave the whole global batch's gradient, summed by the tree, in each parameter's ``.grad``."""
        self._check_model()
        ctx = current.get_replica_context()
        assert ctx is not None
        replicas, rank = ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group
        rows = batch_size_of(x if y is None else y, "a batch")
        p = self.piece
        assert p is not None, "step() is the deterministic mode's; step_global() takes one piece per replica"
        if total is None or total != rows * replicas or rows % p:
            raise ValueError(
                f"enable_op_determinism(piece_size={p}): every global batch must be a multiple of "
                f"{p} x {replicas} replicas = {p * replicas} examples, split evenly; got {rows} examples on "
                f"replica {rank} of a global batch of {total}. Drop the remainder (batch(..., "
                "drop_remainder=True)) or choose a piece size that divides the batch"
            )
        local = rows // p
        first, n = rank * local, local * replicas
        base = self._agreed_base()
        device = self.strategy.extended.device
        pieces: dict[int, Grads] = {}
        for k in range(local):
            part = [None if v is None else slice_batch(v, k * p, (k + 1) * p) for v in (x, y, sw)]
            with self.strategy.no_sync(), generator_at(_seed(base, self.updates, first + k), [device]):
                micro_step(part[0], part[1], part[2], total)
            pieces[first + k] = self._take()
        known = block_sums(pieces, first, first + local, n)
        if replicas > 1:
            known = self._exchange(known, [(r * local, (r + 1) * local) for r in range(replicas)])
        self._finish(known, n, None)

    def step_global(self, x: Any, y: Any, sw: Any, micro_step: MicroStep, commit: Callable[[], None]) -> None:
        """As ``step``, from the whole global batch (every replica has it: ``on_failure="continue"``):
        this replica computes its range of the pieces under the current membership, however many
        replicas there are now, so a lost replica's share is the survivors'. ``commit`` runs once
        the gradient is whole on every replica, before the update counts as done."""
        self._check_model()
        ctx = current.get_replica_context()
        assert ctx is not None
        replicas, rank = ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group
        rows = batch_size_of(x if y is None else y, "a batch")
        p = self.piece
        if p is None:  # one piece per replica: its share, as experimental_distribute_dataset splits
            sizes = split_sizes(rows, replicas)
            bounds = [sum(sizes[:k]) for k in range(replicas + 1)]
        else:
            if rows % p:
                raise ValueError(
                    f"enable_op_determinism(piece_size={p}): every global batch must be a multiple of "
                    f"{p} examples; got a global batch of {rows}. Drop the remainder (batch(..., "
                    "drop_remainder=True)) or choose a piece size that divides the batch"
                )
            bounds = list(range(0, rows + 1, p))
        n = len(bounds) - 1
        ranges = [(r * n // replicas, (r + 1) * n // replicas) for r in range(replicas)]
        first, last = ranges[rank]
        base = self._agreed_base() if p is not None else 0
        pieces: dict[int, Grads] = {}
        for k in range(first, last):
            part = [None if v is None else slice_batch(v, bounds[k], bounds[k + 1]) for v in (x, y, sw)]
            rng = generator_at(_seed(base, self.updates, k), [self.strategy.extended.device]) if p is not None else contextlib.nullcontext()
            with self.strategy.no_sync(), rng:
                micro_step(part[0], part[1], part[2], rows)
            pieces[k] = self._take()
        if p is None and replicas > 1:  # one piece each, no fixed order to keep: one all-reduce
            grads = pieces[first] if last > first else Grads(torch.zeros_like(q) for q in self.params)
            self._all_reduce(grads)
            for param, g in zip(self.params, grads):
                param.grad = g
            commit()
            self.updates += 1
            return
        known = block_sums(pieces, first, last, n)
        if replicas > 1:
            known = self._exchange(known, ranges)
        self._finish(known, n, commit)

    def _all_reduce(self, grads: Grads) -> None:
        """Sum ``grads`` over the replicas in place (one flat all-reduce per dtype)."""
        world = self.strategy.extended.world
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            world.all_reduce_(flat, "sum")
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _finish(self, known: dict[Block, Grads], n: int, commit: Callable[[], None] | None) -> None:
        """The tree's root into each parameter's ``.grad``; ``commit``; the update counted."""
        root = combine(known, n)
        for param, g in zip(self.params, root):
            param.grad = g.to(param.device)
        if commit is not None:
            commit()
        self.updates += 1

    def _exchange(self, mine: dict[Block, Grads], ranges: Sequence[tuple[int, int]]) -> dict[Block, Grads]:
        """Every replica's block sums (``comm/blocks.exchange_blocks``)."""
        return exchange_blocks(self.strategy.extended.world, mine, ranges, self.params)

    def _take(self) -> Grads:
        """The gradients the last piece left (zeros where a parameter got none); cleared."""
        out = []
        for param in self.params:
            g = param.grad
            out.append(torch.zeros_like(param) if g is None else g)
            param.grad = None
        return Grads(out)
