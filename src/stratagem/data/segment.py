"""The batch-building segment: which plan nodes it covers (a plan, as data) and what a
worker process runs for each task (the maps and shards of the segment on each element with the
sequential pipeline's seeds and positions, then the batch stacked into a shared arena)."""

from __future__ import annotations

import dataclasses
import os
import pickle
from multiprocessing.reduction import recv_handle, send_handle
from typing import TYPE_CHECKING, Any

from stratagem.data import sharedmem
from stratagem.data.functions import call, element_rng, function_name
from stratagem.data.iterator import Context
from stratagem.data.structure import normalize_output
from stratagem.data.transforms import MapDataset, ShardDataset

if TYPE_CHECKING:
    from stratagem.data.batching import BatchDataset
    from stratagem.data.parallel import ParallelMapDataset


@dataclasses.dataclass(frozen=True)
class Stage:
    """One map of the segment as the worker runs it (``ctx`` gives its per-element seeds)."""

    fn: Any
    with_rng: bool
    seed: int | None
    name: str
    ctx: Context

    def __call__(self, x: Any, pos: int) -> Any:
        rng = element_rng(self.ctx.seed_sequence(self.seed, pos)) if self.with_rng else None
        return normalize_output(call(self.fn, x, rng))


@dataclasses.dataclass(frozen=True)
class Keep:
    """A ``shard(n, i)`` step: keeps the elements at positions ``p % n == i``."""

    n: int
    i: int

    def __call__(self, pos: int) -> bool:
        return pos % self.n == self.i


@dataclasses.dataclass(frozen=True)
class Segment:
    """parallel map -> maps and shards -> batch: what one worker task runs. (A shard keeps a
    known share of positions, so the main process can still cut the input into batches.)"""

    pm: ParallelMapDataset
    steps: tuple[MapDataset | ShardDataset, ...]  # in application order
    batch: BatchDataset

    def describe(self) -> str:
        names = [f"{self.pm._name}({function_name(self.pm._fn)})"]
        names += [f"shard({s._num_shards}, {s._index})" if isinstance(s, ShardDataset)
                  else f"{s._name}({function_name(s._fn)})" for s in self.steps]
        kind = "padded_batch" if self.batch._padded else "batch"
        return " -> ".join([*names, f"{kind}({self.batch.batch_size})"])


def find_segment(batch: BatchDataset) -> Segment | None:
    """The segment ending at ``batch``, if a parallel map feeds it through sequential maps
    and shards only (auto-shard's DATA policy puts a shard right before the batch)."""
    from stratagem.data.parallel import ParallelMapDataset

    steps: list[MapDataset | ShardDataset] = []
    node = batch._inputs[0]
    while isinstance(node, MapDataset | ShardDataset):
        steps.append(node)
        node = node._inputs[0]
    if not isinstance(node, ParallelMapDataset):
        return None
    return Segment(node, tuple(reversed(steps)), batch)


def pm_context(segment: Segment, ctx: Context) -> Context:
    """The parallel map's context, given the batch's (each node's input is child 0)."""
    for _ in range(len(segment.steps) + 1):
        ctx = ctx.child(0)
    return ctx


# -- worker process ----------------------------------------------------------------------
def _send(conn: Any, msg: Any) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _worker_main(
    conn: Any, stages: list[Any], batch: BatchDataset, sources: sharedmem.Sources,
    initial: list[sharedmem.Arena], close: list[int],
) -> None:
    from stratagem.data.parallel import _portable_error

    for fd in close:  # the main process's ends of other workers' pipes (inherited by fork)
        try:
            os.close(fd)
        except OSError:
            pass
    inputs: dict[int, sharedmem.Arena] = {}
    outputs: dict[int, sharedmem.Arena] = dict(enumerate(initial))  # mapped before the fork
    free: set[int] = set(outputs)
    ids = [len(initial)]  # the next output arena id (never reused)
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            os._exit(0)  # nothing to flush or finalize: skip the interpreter's teardown
        if msg[0] == "arena":
            inputs[msg[1]] = sharedmem.Arena(msg[2], recv_handle(conn))
            continue
        _, tid, aid, skel, descs, positions, qs, collate, released = msg
        free.update(released)
        elements = sharedmem.read_inputs(skel, descs, inputs.get(aid), sources)
        outs = []
        error = None
        q = list(qs)  # each step's position counter, as in the sequential pipeline
        for i, x in enumerate(elements):
            stage, pos = 0, positions[i]
            try:
                y = stages[0](x, pos)
                for stage in range(1, len(stages)):
                    pos = q[stage - 1]
                    q[stage - 1] += 1
                    step = stages[stage]
                    if isinstance(step, Keep):
                        if not step(pos):
                            break
                    else:
                        y = step(y, pos)
                else:
                    outs.append(y)
            except Exception as e:
                error = ("error", tid, stage, pos, *_portable_error(e))
                break
        del elements
        if error is not None or not collate:
            _send(conn, error or ("done", tid, None, None, None, []))
            continue
        try:
            need = sharedmem.batch_bytes(outs) if not batch._padded else 0
            arena_id, dropped = _take_arena(outputs, free, need, ids)
            bump = sharedmem.Bump(outputs[arena_id])
            value = batch.collate(outs, alloc=bump.alloc)
            del outs
            skel, descs, missing = sharedmem.describe_batch(value, bump)
            if missing and bump.used + missing > bump.arena.size:  # padded: a bigger arena
                free.add(arena_id)
                arena_id, more = _take_arena(outputs, free, bump.used + missing, ids)
                dropped += more
                old, bump = bump, sharedmem.Bump(outputs[arena_id])
                descs = _move(descs, old, bump)
            descs = sharedmem.place_rest(descs, bump)
            del value
        except Exception as e:
            _send(conn, ("error", tid, None, None, *_portable_error(e)))
            continue
        arena = outputs[arena_id]
        _send(conn, ("done", tid, arena_id, arena.size if arena.fd is not None else None,
                     (skel, descs), dropped))
        if arena.fd is not None:
            send_handle(conn, arena.fd, os.getppid())
            arena.close_fd()


def _take_arena(
    outputs: dict[int, sharedmem.Arena], free: set[int], need: int, ids: list[int]
) -> tuple[int, list[int]]:
    """A free arena of at least ``need`` bytes, else a new one; free arenas too small for
    this batch are dropped (returned, so the main process unmaps them too)."""
    fits = [a for a in free if outputs[a].size >= need]
    if fits:
        best = min(fits, key=lambda a: outputs[a].size)
        free.discard(best)
        return best, []
    dropped = [a for a in free if a in outputs]
    for a in dropped:
        del outputs[a]
    free.clear()
    new = ids[0]
    ids[0] += 1
    outputs[new] = sharedmem.Arena(need)
    return new, dropped


def _move(descs: list[Any], old: sharedmem.Bump, new: sharedmem.Bump) -> list[Any]:
    out = []
    for d in descs:
        if d[0] == "T":
            _, dtype, shape, offset = d
            region = new.alloc(shape, dtype)
            assert region is not None
            region.copy_(old.arena.region(offset, dtype, shape))
            out.append(("T", dtype, shape, new.placed[id(region)]))
        else:
            out.append(d)
    return out


def stages(segment: Segment, ctx: Context) -> tuple[list[Stage | Keep], Context]:
    """The segment's steps as a worker runs them (the parallel map first), given the batch's
    context, and the parallel map's context."""
    step_ctxs = []
    c = ctx
    for _ in segment.steps:  # batch -> last step -> ... -> first step -> parallel map
        c = c.child(0)
        step_ctxs.append(c)
    pm_ctx = c.child(0)
    step_ctxs.reverse()
    pm = segment.pm
    out: list[Stage | Keep] = [Stage(pm._fn, pm._with_rng, pm._seed, pm._name, pm_ctx)]
    for s, sc in zip(segment.steps, step_ctxs):
        if isinstance(s, ShardDataset):
            out.append(Keep(s._num_shards, s._index))
        else:
            out.append(Stage(s._fn, s._with_rng, s._seed, s._name, sc))
    return out, pm_ctx
