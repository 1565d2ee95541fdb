"""Measurements behind the cost model (``cost_model.py``): gloo collectives, copies, the store, steps.

The ``*_worker`` functions run in every process of a job ``run_workers`` starts (RANK, WORLD_SIZE,
MASTER_ADDR/PORT set) and return rank 0's measurements. Each times, in the same rounds, the plain
collectives that calibrate the model (``calibration``: each kind at a few sizes, and a copy into a
fresh buffer) and what the model predicts from them: the library's gradient exchanges
(``exchange_worker``: the default mode's buckets all-reduced, the deterministic mode's
``reduce_blocks``) or a training step under a strategy against its compute alone on every process
at once (``step_worker``). Rounds interleave the two, so this shared machine's noise falls on
both alike. ``store_rate`` counts a TCPStore's calls a second from a few client processes.
``benchmarks/cost_model.py`` prints them against the model; ``tests/test_cost_model.py`` checks one.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: the collectives timed, as the model names them; "copy" is a local copy into a fresh buffer
#: ("all_gather_fresh": the list form into tensors made for the call, then concatenated, as
#: ``Communicator.all_gather_tensor`` and ``comm/blocks.SlicedTree.gathered`` do)
KINDS = ("all_reduce", "all_gather", "all_gather_list", "all_gather_fresh", "reduce_scatter", "all_to_all", "copy")

# torch 2.13 renamed the flat collectives (the old names warn); torch 2.4 has only the old ones
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _rank_world() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def low(times: Sequence[float]) -> float:
    """The lower quartile: on a shared machine noise only adds time, so the low quantile of many
    repetitions is the steady figure (the median follows the neighbours' load)."""
    return statistics.quantiles(times, n=4)[0] if len(times) > 1 else times[0]


def _timed(fn: Callable[[], Any], reps: int, warmup: int = 1) -> list[float]:
    """The slowest rank's seconds for each of ``reps`` calls of ``fn`` (every rank starts together)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _collective(kind: str, numel: int, world: int) -> Callable[[], Any]:
    """One collective over a tensor of ``numel`` float32 elements (the whole tensor: the
    all-reduce's, the all-gather's output, the reduce-scatter's input, the all-to-all's send).
    ``all_gather`` is the flat form FSDP2 calls, ``all_gather_list`` the list form of
    ``comm/blocks.py``; ``copy`` copies ``numel`` elements into a buffer made for it."""
    numel -= numel % world
    if kind == "all_reduce":
        t = torch.ones(numel)
        return lambda: dist.all_reduce(t)
    if kind == "all_gather":
        out, mine = torch.empty(numel), torch.ones(numel // world)
        return lambda: _all_gather_flat(out, mine)
    if kind == "all_gather_list":
        outs, mine = list(torch.empty(numel).chunk(world)), torch.ones(numel // world)
        return lambda: dist.all_gather(outs, mine)
    if kind == "all_gather_fresh":
        part = torch.ones(numel // world)
        return lambda: torch.cat([t for t in _gather_fresh(part, world)])
    if kind == "reduce_scatter":
        inp, out = torch.ones(numel), torch.empty(numel // world)
        return lambda: _reduce_scatter_flat(out, inp)
    if kind == "all_to_all":
        send, recv = torch.ones(numel), torch.empty(numel)
        return lambda: dist.all_to_all_single(recv, send)
    if kind == "copy":
        src = torch.ones(numel)
        return lambda: torch.empty(numel).copy_(src)
    raise ValueError(f"unknown collective {kind!r}; one of {KINDS}")


def _gather_fresh(part: torch.Tensor, world: int) -> list[torch.Tensor]:
    outs = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(outs, part)
    return outs


class Calibration:
    """The plain collectives of ``kinds`` at ``sizes`` (float32 elements), timed a round at a time."""

    def __init__(self, world: int, sizes: Sequence[int], kinds: Sequence[str] = KINDS) -> None:
        self.world = world
        self.fns = {(kind, m): _collective(kind, m, world) for kind in kinds for m in sizes}
        self.times: dict[tuple[str, int], list[float]] = {key: [] for key in self.fns}

    def round(self, reps: int) -> None:
        for key, fn in self.fns.items():
            self.times[key].extend(_timed(fn, reps))

    def result(self) -> dict[str, list[tuple[int, float]]]:
        """Per kind, ``(bytes of the whole tensor, seconds)`` at each size: the lower quartile of
        every repetition of every round."""
        out: dict[str, list[tuple[int, float]]] = {}
        for (kind, m), ts in self.times.items():
            out.setdefault(kind, []).append(((m - m % self.world) * 4, low(ts)))
        return out


def collectives_worker(sizes: Sequence[int], rounds: int, reps: int = 3, kinds: Sequence[str] = KINDS) -> Any:
    """The calibration alone, on gloo: rank 0's ``Calibration.result()``, None elsewhere."""
    torch.set_num_threads(1)
    rank, world = _rank_world()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cal = Calibration(world, sizes, kinds)
        for _ in range(rounds):
            cal.round(reps)
        return cal.result() if rank == 0 else None
    finally:
        dist.destroy_process_group()


def store_rate(clients: int, seconds: float = 2.0) -> float:
    """TCPStore calls a second (``add`` of one key a client, each call waiting for its answer),
    with ``clients`` client processes hammering one store hosted in this process."""
    import multiprocessing as mp

    from stratagem.cluster import find_free_port

    port = find_free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    procs = [ctx.Process(target=_store_client, args=(port, i, seconds, done)) for i in range(clients)]
    for p in procs:
        p.start()
    total = sum(done.get(timeout=120 + seconds) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    del server
    return total / seconds


def _store_client(port: int, i: int, seconds: float, done: Any) -> None:
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    key, calls = f"cost/{i}", 0
    client.add(key, 1)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        client.add(key, 1)
        calls += 1
    done.put(calls)


# --- library exchanges ------------------------------------------------------------------------


def exchange_worker(numels: Sequence[int], sizes: Sequence[int], rounds: int, reps: int = 3,
                    pieces_per_replica: int = 1) -> dict[str, Any] | None:  # fmt: skip
    """The library's gradient exchanges of float32 gradients of ``numels`` elements (one tensor a
    parameter), timed in the same rounds as the calibration (``sizes`` elements):

    - ``default``: the default mode's buckets (``comm/buckets.py``'s plan: 1 MB, then 25 MB), each
      flat and kept, all-reduced as the reducer does (started together, waited for in order);
    - ``deterministic``: ``comm/blocks.reduce_blocks`` (the custom loop's exchange) with
      ``pieces_per_replica`` pieces on each replica.

    Rank 0's result (None elsewhere): ``{"collectives": Calibration.result(), "default": s,
    "deterministic": s, "buckets": [bytes, ...], "blocks": k, "all_blocks": K}``: lower quartiles
    of every repetition."""
    from stratagem.comm import ProcessGroupCommunicator
    from stratagem.comm.blocks import Grads, reduce_blocks
    from stratagem.comm.buckets import ParamSpec, plan_buckets
    from stratagem.core.canonical import block_sums, blocks

    torch.set_num_threads(1)
    rank, world = _rank_world()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        comm = ProcessGroupCommunicator(dist.group.WORLD, torch.device("cpu"))
        params = [torch.zeros(m) for m in numels]
        buckets = plan_buckets([ParamSpec(str(i), m, 4, "float32", "cpu") for i, m in enumerate(numels)])
        flats = [torch.ones(b.numel) for b in buckets]

        def default() -> None:
            works = [comm.all_reduce_async(f) for f in flats]
            for w in works:
                w.wait()

        local = pieces_per_replica
        n = local * world
        ranges = [(r * local, (r + 1) * local) for r in range(world)]
        lo, hi = ranges[rank]
        mine = {k: Grads(torch.full((m,), float(k)) for m in numels) for k in range(lo, hi)}
        sums = block_sums(mine, lo, hi, n)

        def deterministic() -> None:
            reduce_blocks(comm, sums, ranges, params, n)

        cal = Calibration(world, sizes)
        times: dict[str, list[float]] = {"default": [], "deterministic": []}
        for _ in range(rounds):
            cal.round(reps)
            times["default"].extend(_timed(default, reps))
            times["deterministic"].extend(_timed(deterministic, reps))
        out = {"collectives": cal.result(), **{k: low(v) for k, v in times.items()},
               "buckets": [b.numel * 4 for b in buckets], "blocks": len(blocks(lo, hi)),
               "all_blocks": sum(len(blocks(a, b)) for a, b in ranges)}  # fmt: skip
        return out if rank == 0 else None
    finally:
        dist.destroy_process_group()


# --- training steps ---------------------------------------------------------------------------


def mlp(width: int, depth: int, inputs: int = 256, classes: int = 10) -> nn.Sequential:
    """The checks' model: ``depth`` Linear(width) + GELU blocks between an input and a head."""
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class _Counting:
    """torch.distributed's collectives wrapped to count calls (a measurement of this process only)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
             "reduce_scatter_single", "all_to_all_single", "broadcast", "barrier")  # fmt: skip

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Counting:
        for name in self.NAMES:
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            self._saved[name] = orig

            def wrapped(*a: Any, _orig: Any = orig, _name: str = name, **k: Any) -> Any:
                self.counts[_name] = self.counts.get(_name, 0) + 1
                return _orig(*a, **k)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, orig in self._saved.items():
            setattr(dist, name, orig)


class _G(tuple):  # type: ignore[type-arg]
    def __add__(self, other: Any) -> _G:  # type: ignore[override]
        return _G(a + b for a, b in zip(self, other))


def step_worker(
    strategy_name: str, width: int, depth: int, global_batch: int, steps: int, rounds: int, sizes: Sequence[int],
    piece: int = 32, reps: int = 3,
) -> dict[str, Any] | None:  # fmt: skip
    """A training step of the checks' MLP (AdamW, global clipping) under ``strategy_name``
    (``mirrored``; ``deterministic``: Mirrored with ``enable_op_determinism(piece_size=piece)``;
    ``sharded``: ShardedStrategy, FSDP2) by ``fit``, against its compute alone: the same step by
    plain torch on this replica's rows, every process at once, no collective (under the
    deterministic mode its pieces, each forward and backward alone, summed in the tree's order;
    sharded, the optimizer and clipping over 1/N of the parameters, as FSDP's shards are: their
    time on the whole model, over N). Each round: the calibration, the compute, a fit; each step
    the slowest rank's, the lower quartile of them all. Also the collectives a
    step of fit calls (counted on rank 0), the model's parameter sizes, the FSDP units' and the
    reducer's buckets. Rank 0's result, None elsewhere."""
    import stratagem as sg
    from stratagem.comm.buckets import ParamSpec, plan_buckets
    from stratagem.core.canonical import block_sums, combine

    torch.set_num_threads(1)
    rank, world = _rank_world()
    rows = global_batch // world
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(global_batch, 256, generator=g), torch.randint(0, 10, (global_batch,), generator=g))
            for _ in range(steps)]  # fmt: skip
    if strategy_name == "sharded":
        strategy: Any = sg.ShardedStrategy(devices="cpu", num_replicas=world)
    else:
        strategy = sg.MirroredStrategy(devices="cpu", num_replicas=world)
    torch.set_num_threads(1)
    if strategy_name == "deterministic":
        sg.experimental.enable_op_determinism(piece_size=piece)
    torch.manual_seed(0)
    with strategy.scope():
        model = mlp(width, depth)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    local = mlp(width, depth)
    local_opt = torch.optim.AdamW(local.parameters(), lr=1e-4)
    mine = [(x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]) for x, y in data]
    share = 1.0 / world if strategy_name == "sharded" else 1.0

    def compute_round() -> list[float]:
        times = []
        for x, y in mine:
            dist.barrier()
            t0 = time.perf_counter()
            local_opt.zero_grad(set_to_none=True)
            if strategy_name == "deterministic":
                pieces = {}
                n = rows // piece
                for k in range(n):
                    local.zero_grad(set_to_none=True)
                    loss_fn(local(x[k * piece : (k + 1) * piece]), y[k * piece : (k + 1) * piece]).backward()
                    pieces[k] = _G(q.grad for q in local.parameters())
                root = combine(block_sums(pieces, 0, n, n), n)
                for q, r in zip(local.parameters(), root):
                    q.grad = r
            else:
                loss_fn(local(x), y).backward()
            t1 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(local.parameters(), 1.0)
            local_opt.step()
            t2 = time.perf_counter()
            times.append((t1 - t0) + share * (t2 - t1))
        t = torch.tensor(times[1:], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    step_times: list[float] = []

    class StepTimes(sg.Callback):
        may_stop_per_batch = False

        def __init__(self) -> None:
            self.last = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.last = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            step_times.append(time.perf_counter() - self.last)

    def fit_once() -> list[float]:
        step_times.clear()
        sg.fit(model, opt, nn.CrossEntropyLoss(), data, global_clipnorm=1.0, strategy=strategy, verbose=0,
               callbacks=[StepTimes()])  # fmt: skip
        return list(step_times)

    def strategy_round() -> list[float]:
        t = torch.tensor(fit_once()[1:], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    compute_round(), strategy_round()  # warm up
    with _Counting() as counter:
        fit_once()
    counts = {k: v / steps for k, v in counter.counts.items()}
    cal = Calibration(world, sizes)
    comp: list[float] = []
    step: list[float] = []
    for _ in range(rounds):
        cal.round(reps)
        comp.extend(compute_round())
        step.extend(strategy_round())
    numels = [q.numel() for q in local.parameters()]
    buckets = plan_buckets([ParamSpec(str(i), m, 4, "float32", "cpu") for i, m in enumerate(numels)])
    units = [sum(q.numel() for q in m.parameters()) for m in local if any(True for _ in m.parameters())]
    out = {"compute": low(comp), "step": low(step), "params": sum(numels),
           "collectives_per_step": counts, "rows": rows, "collectives": cal.result(),
           "buckets": [b.numel * 4 for b in buckets], "units": [4 * u for u in units]}  # fmt: skip
    if strategy_name == "deterministic":
        sg.experimental.disable_op_determinism()
    return out if rank == 0 else None
