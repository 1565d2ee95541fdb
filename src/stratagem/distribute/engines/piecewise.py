"""``strategy.run`` in the deterministic mode: the step called once per piece of the replica's batch.

A custom loop's step (``loss.backward(); clip; optimizer.step()`` inside ``strategy.run``) gets the
same bits on one process and on any number of replicas when the replica's batch is cut into
fixed ``piece_size``-row pieces, each run alone, and their gradients summed in one fixed tree
(``core/canonical.py``; docs/design/DETERMINISM.md, "strategy.run calls the step once per piece").

Each piece runs the user's step with the piece's rows (every tensor argument cut along its first
dimension), its random numbers drawn from a generator set by the run and the piece's index in
the global batch. A hook on each trainable mirrored parameter takes the piece's gradient as it
arrives (before it is added to ``.grad``); at the end of that backward pass the parameter's
``.grad`` is put back as it was before it (so in every piece but the last, clipping and the
optimizer see no gradient: a step is a no-op for torch's optimizers), and at the end of the last
piece's backward the replicas finish the tree from their block sums (``comm/blocks.py``) and
``.grad`` becomes what it was plus the tree's root: the clipping and the optimizer step that
follow see the whole global batch's gradient. What the step returns is combined over the pieces:
numbers and 0-d tensors are summed (``compute_average_loss(..., global_batch_size)`` per piece
adds up to the replica's), tensors of the piece's rows are concatenated. ``compute_average_loss``
without a batch size counts the global batch, not the piece.

Refused: an optimizer whose ``step`` acts without gradients (the first pieces would step it),
a learning-rate scheduler stepped inside the step (it would step once per piece): step them
outside ``strategy.run`` (said in the docs; not detectable in general).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from stratagem.comm.blocks import Grads, agreed_seed, generator_at, reduce_blocks
from stratagem.core import tree
from stratagem.core.canonical import block_sums
from stratagem.distribute import determinism
from stratagem.distribute.context import pieces_of_global_batch
from stratagem.distribute.determinism import OpDeterminism

Call = Callable[[Sequence[Any], Mapping[str, Any]], Any]


def _seed(base: int, run: int, piece: int) -> int:
    return (base * 1_000_003 + run * 65_537 + piece + 7_919) % (2**63 - 1)


class PiecewiseRun:
    """The deterministic mode's ``strategy.run`` for one data-parallel engine."""

    def __init__(
        self, comm: Any, device: torch.device | None, params: Callable[[], list[torch.Tensor]],
        batch_norms: Callable[[], list[torch.nn.Module]],
    ) -> None:  # fmt: skip
        self.comm = comm
        self.device = device
        self.params = params
        self.batch_norms = batch_norms
        self._base: int | None = None

    def _agreed_base(self) -> int:
        if self._base is None:
            self._base = agreed_seed(self.comm)
        return self._base

    def __call__(self, mode: OpDeterminism, args: Sequence[Any], kwargs: Mapping[str, Any], call: Call) -> Any:
        leaves = [t for t in tree.flatten((list(args), dict(kwargs)))[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
        if not leaves:  # no batch to cut (fit's own execution, an eval without inputs): one call
            return call(args, kwargs)
        training = self.batch_norms()
        if training:
            raise ValueError(
                f"enable_op_determinism: {type(training[0]).__name__} is in training mode, whose statistics "
                "are over a batch, not a piece: the bits would depend on the replica count. Use GroupNorm "
                "or LayerNorm, freeze it (eval()), or disable_op_determinism()"
            )
        rows = leaves[0].shape[0]
        if any(t.shape[0] != rows for t in leaves):
            raise ValueError(
                "enable_op_determinism: strategy.run cuts every tensor argument into pieces along its "
                f"first dimension, so they must share it; got first dimensions {[t.shape[0] for t in leaves]}"
            )
        p = mode.piece_size
        replicas, rank = self.comm.world_size, self.comm.rank
        if rows % p:
            raise ValueError(
                f"enable_op_determinism(piece_size={p}): each replica's batch must be a multiple of {p} "
                f"rows (the global batch a multiple of {p} x {replicas} replicas = {p * replicas}); got "
                f"{rows} rows on replica {rank}. Drop the remainder (batch(..., drop_remainder=True)) or "
                "choose a piece size that divides the batch"
            )
        local = rows // p
        first, n = rank * local, local * replicas
        ranges = [(r * local, (r + 1) * local) for r in range(replicas)]
        params = self.params()
        base = self._agreed_base()
        taken: dict[int, Grads] = {}
        fired: list[bool] = []
        outputs = []
        for k in range(local):
            last = k == local - 1
            catcher = _PieceGradients(params)
            piece_args, piece_kwargs = tree.map_structure(
                lambda v, lo=k * p: v[lo : lo + p] if isinstance(v, torch.Tensor) and v.dim() > 0 else v,
                (list(args), dict(kwargs)),
            )
            def at_end(c: _PieceGradients = catcher, i: int = first + k, last: bool = last) -> None:
                taken[i] = c.grads()
                if not last:  # as before this backward: the step's clipping and optimizer see nothing
                    for q, b in zip(params, c.before):
                        q.grad = b
                    return
                root = reduce_blocks(self.comm, block_sums(taken, first, first + local, n), ranges, params, n)
                for q, b, g in zip(params, c.before, root):
                    q.grad = g if b is None else b + g

            catcher.at_end = at_end
            with catcher, generator_at(_seed(base, determinism.piece_runs(), first + k), [self.device]), pieces_of_global_batch(rows * replicas, n):
                outputs.append(call(piece_args, piece_kwargs))
            fired.append(catcher.fired)
            if any(fired) and not all(fired):
                raise RuntimeError(
                    "enable_op_determinism: the step computed gradients in some of its pieces and not in "
                    "others; strategy.run calls the step once per piece, so each call must run backward "
                    "alike (or none of them)"
                )
        determinism.count_piece_run()
        return _combined(outputs, p)

class _PieceGradients:
    """While one piece runs: each parameter's gradient as it arrives, ``.grad`` as it was before
    that backward pass, and ``at_end`` called when the pass ends."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.got: list[torch.Tensor | None] = [None] * len(params)
        self.before: list[torch.Tensor | None] = [None] * len(params)
        self.fired = False
        self.at_end: Callable[[], None] = lambda: None
        self._handles: list[Any] = []

    def __enter__(self) -> _PieceGradients:
        for i, q in enumerate(self.params):
            self._handles.append(q.register_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            if not self.fired:
                self.fired = True
                # what every .grad holds now (the user's zero_grad seen), before this pass adds to it
                self.before = [None if q.grad is None else q.grad.detach().clone() for q in self.params]
                torch.autograd.Variable._execution_engine.queue_callback(self.at_end)
            self.got[i] = g.detach().clone() if self.got[i] is None else self.got[i] + g  # type: ignore[operator]

        return hook

    def grads(self) -> Grads:
        return Grads(torch.zeros_like(q) if g is None else g for q, g in zip(self.params, self.got))


def _combined(outputs: list[Any], p: int) -> Any:
    """The pieces' return values as one replica's: numbers and 0-d tensors summed, tensors of the
    piece's rows concatenated (detached: the pieces' graphs are gone, their backward done)."""
    outputs = [tree.map_structure(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, o) for o in outputs]
    flat = [tree.flatten(o) for o in outputs]
    leaves0, treedef = flat[0]
    out = []
    for j, v in enumerate(leaves0):
        column = [f[0][j] for f in flat]
        if isinstance(v, torch.Tensor) and v.dim() == 0 or isinstance(v, (int, float)) and not isinstance(v, bool):
            total = column[0]
            for c in column[1:]:
                total = total + c
            out.append(total)
        elif isinstance(v, torch.Tensor) and v.shape[0] == p:
            out.append(torch.cat(column))
        elif v is None or all(c is v or c == v for c in column):
            out.append(v)
        else:
            raise ValueError(
                "enable_op_determinism: strategy.run calls the step once per piece and combines what it "
                "returns (numbers and 0-d tensors summed, tensors of the piece's rows concatenated); "
                f"it cannot combine a {type(v).__name__}"
                + (f" of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else "")
            )
    return tree.unflatten(treedef, out)
