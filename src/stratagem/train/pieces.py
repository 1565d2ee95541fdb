"""fit's step in the deterministic mode: the replica's batch in pieces, summed by one fixed tree.

Each ``piece_size``-row piece of a replica's batch runs forward and backward alone (the gradient
reducer off, its random numbers from a generator set by the update and the piece's index in the
global batch), its gradient is taken, and the pieces of the whole global batch are summed in
``core/canonical.py``'s tree: this replica's blocks locally, then each replica finishes the tree
on its slice of the gradient from every replica's blocks of that slice, and the finished slices
are gathered (``comm/blocks.py``). The result has the same bits on one process and on any number
of replicas (docs/design/DETERMINISM.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.comm.blocks import (
    Grads,
    OverlappedExchange,
    agreed_seed,
    generator_at,
    reduce_blocks,
)
from stratagem.core.batches import batch_size_of, slice_batch, split_sizes
from stratagem.core.canonical import block_sums
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
        #: the deterministic mode's exchange overlapped with the last piece's backward (fit's own
        #: steps; under ``on_failure="continue"`` the exchange stays one collective after it)
        self._exchange = OverlappedExchange(self.params) if self.piece is not None and OverlappedExchange.supports(self.params) else None

    def _check_model(self) -> None:
        for name, m in self._batch_norms:
            if m.training:
                raise ValueError(
                    f"enable_op_determinism: {name} is {type(m).__name__} in training mode, whose "
                    "statistics are over a batch, not a piece: the bits would depend on the replica count. "
                    "Use GroupNorm or LayerNorm, freeze it (eval()), or disable_op_determinism()"
                )

    @property
    def base_seed(self) -> int | None:
        """The agreed seed (None: not agreed yet; it is at the first step)."""
        return self._base

    def adopt_base_seed(self, seed: int) -> None:
        """The seed another replica agreed (``on_failure="continue"``: a survivor whose broadcast
        of it failed takes it from one whose did not, instead of broadcasting again alone)."""
        self._base = int(seed)

    def _agreed_base(self) -> int:
        """The chief's ``torch.initial_seed()``: the pieces' generators start from the same seed on
        every replica and on one process, as the user seeded it."""
        if self._base is None:
            self._base = agreed_seed(self.strategy.extended.world)
        return self._base

    def _replica(self) -> tuple[int, int]:
        """(replicas now, this replica's rank), checking the model first."""
        self._check_model()
        ctx = current.get_replica_context()
        assert ctx is not None
        return ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group

    def step(self, x: Any, y: Any, sw: Any, total: int | None, micro_step: MicroStep) -> None:
        """Leave the whole global batch's gradient, summed by the tree, in each parameter's ``.grad``."""
        replicas, rank = self._replica()
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
        # this replica's rows are global pieces rank * local, ...; its own rows start at 0
        self._run(x, y, sw, total, micro_step, [(r * local, (r + 1) * local) for r in range(replicas)], rank,
                  lambda k: (k - rank * local) * p, None)  # fmt: skip

    def step_global(self, x: Any, y: Any, sw: Any, micro_step: MicroStep, commit: Callable[[], None]) -> None:
        """As ``step``, from the whole global batch (every replica has it: ``on_failure="continue"``):
        this replica computes its range of the pieces under the current membership, however many
        replicas there are now, so a lost replica's share is the survivors'. ``commit`` runs once
        the gradient is whole on every replica, before the update counts as done."""
        replicas, rank = self._replica()
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
        self._run(x, y, sw, rows, micro_step, ranges, rank, bounds.__getitem__, commit)

    def _run(
        self, x: Any, y: Any, sw: Any, total: int | None, micro_step: MicroStep, ranges: Sequence[tuple[int, int]],
        rank: int, start: Callable[[int], int], commit: Callable[[], None] | None,
    ) -> None:  # fmt: skip
        """Pieces ``ranges[rank]`` of the global batch (piece ``k``: this replica's rows
        ``start(k)`` to ``start(k + 1)``), each alone (seeded in the deterministic mode), then
        their sum: the fixed tree (deterministic mode), or one all-reduce of one piece per
        replica; ``.grad`` set, ``commit``, the update counted."""
        first, last = ranges[rank]
        n, p = ranges[-1][1], self.piece
        base = self._agreed_base() if p is not None else 0
        device = self.strategy.extended.device
        pieces: dict[int, Grads] = {}
        world = self.strategy.extended.world
        exchange = self._exchange if commit is None and last > first and world.world_size > 1 else None
        for k in range(first, last):
            part = [None if v is None else slice_batch(v, start(k), start(k + 1)) for v in (x, y, sw)]
            rng = generator_at(_seed(base, self.updates, k), [device]) if p is not None else contextlib.nullcontext()
            during = (exchange.during(world, pieces, first, last, n, ranges) if exchange is not None and k == last - 1
                      else contextlib.nullcontext())  # fmt: skip
            with self.strategy.no_sync(), rng, during:
                micro_step(part[0], part[1], part[2], total)
            pieces[k] = self._take()
        if p is None:  # one piece each, no fixed order to keep: one all-reduce
            mine = pieces[first] if last > first else Grads(torch.zeros_like(q) for q in self.params)
            grads = list(world.all_reduce(list(mine), "sum", check=False))
        elif exchange is not None:
            grads = exchange.finish()
        else:
            grads = reduce_blocks(world, block_sums(pieces, first, last, n), ranges, self.params, n)
        for param, g in zip(self.params, grads):
            param.grad = g.to(param.device)
        if commit is not None:
            commit()
        self.updates += 1

    def _take(self) -> Grads:
        """The gradients the last piece left (zeros where a parameter got none); cleared."""
        out = []
        for param in self.params:
            g = param.grad
            out.append(torch.zeros_like(param) if g is None else g)
            param.grad = None
        return Grads(out)
