"""The cost model of docs/SCALE.md: what each strategy sends, holds and asks of the store, per rank, as N grows.

Plain data and pure functions, no process group. ``costs(strategy, n, params, batch, ...)`` is one
optimizer step of a job: its collectives (each with the bytes of its whole tensor and its group),
so the bytes each rank sends follow (a ring all-reduce sends ``2(N-1)/N`` of its tensor; an
all-gather, a reduce-scatter or an all-to-all ``(N-1)/N``), its memory per rank, its store calls
(the control plane of ``comm/heartbeat.py`` / ``comm/verdict.py``: 2 a rank a second, 8 more for
the watcher, about 6 a rank at start-up), what a rank copies locally, and the pipeline's bubble.
A ``Fabric`` turns collectives into seconds (``latency`` per hop of the algorithm plus the bytes a
rank sends over a bus bandwidth, as nccl-tests reports ``busbw``): ``fit_link`` calibrates one
from timings taken here (``cost_probe.py``; ``MeasuredLink`` keeps the timed points themselves, what
the checks at 2-16 processes predict from), ``nccl_fabric`` and ``tpu_fabric`` hold published figures.
``predict`` gives a step's time and scaling efficiency on accelerators and ``limits`` names what
breaks first. ``benchmarks/cost_model.py`` measures the constants and checks the model against
runs of 2-16 gloo processes; ``tests/test_cost_model.py`` holds its invariants.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stratagem.core.canonical import blocks

MB = 1024 * 1024
GB = 1e9

#: the strategies and modes the model covers (``multiworker`` costs what ``mirrored`` does)
STRATEGIES = ("mirrored", "multiworker", "deterministic", "failover", "sharded", "hsdp", "tensor",
              "pipeline", "ps", "tpu")  # fmt: skip

#: the control plane's store calls (measured by the simulation, docs/SCALE.md "The control plane"):
#: a rank's beat and its read of the verdict each beat; the watcher's calls a beat; a rank's at start-up
CALLS_PER_BEAT_PER_RANK = 2
WATCHER_CALLS_PER_BEAT = 8
STARTUP_CALLS_PER_RANK = 6
#: ParameterServerStrategy's ClusterWatch (``distribute/engines/ps_watch.py``): a beat every 0.25 s;
#: a task's beat and its look for the chief's end (2), and its look at the chief (3 when remote);
#: the chief's beat and its look at each task (3)
PS_BEATS_PER_SECOND = 4


# --- collectives --------------------------------------------------------------------------------


def sent_fraction(kind: str, n: int) -> float:
    """The share of a collective's whole tensor one of ``n`` ranks sends (ring algorithms;
    an all-to-all sends every part but its own)."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "all_gather_list", "all_gather_fresh", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind in ("broadcast", "send"):
        return 1.0
    raise ValueError(f"unknown collective {kind!r}")


def hops(kind: str, n: int, tree: bool = False) -> float:
    """Steps of the algorithm one after another, each paying a latency: a ring all-reduce
    2(N-1), NCCL's tree 2 log2 N; an all-gather, reduce-scatter or all-to-all N-1; a send 1."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * math.ceil(math.log2(n)) if tree else 2 * (n - 1)
    if kind == "broadcast":
        return math.ceil(math.log2(n)) if tree else n - 1
    if kind == "send":
        return 1.0
    return n - 1.0


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of one kind per step, each over a tensor of ``size`` bytes (the
    all-reduce's tensor, the all-gather's output, the reduce-scatter's input, the all-to-all's
    send buffer) among ``group`` ranks; ``hidden``: started while compute runs (an accelerator
    overlaps it, this 2-core machine does not); ``what``: where in the step."""

    kind: str
    size: float
    group: int
    count: float = 1.0
    hidden: bool = False
    what: str = ""

    @property
    def sent(self) -> float:
        """Bytes each rank sends for these collectives in one step."""
        return self.count * sent_fraction(self.kind, self.group) * self.size

    def __str__(self) -> str:
        return f"{self.count:g} x {self.kind}({self.size / MB:.2f} MB / {self.group})"


@dataclass(frozen=True)
class Link:
    """One collective kind on one fabric: ``latency`` seconds a hop, ``busbw`` bytes a second
    (what a rank sends over the time, nccl-tests' bus bandwidth)."""

    latency: float
    busbw: float

    def seconds(self, kind: str, size: float, group: int, tree: bool = False) -> float:
        if group <= 1:
            return 0.0
        return hops(kind, group, tree) * self.latency + sent_fraction(kind, group) * size / self.busbw


@dataclass(frozen=True)
class MeasuredLink:
    """One collective kind on ``group`` ranks, as timed: ``points`` of (bytes of the whole tensor,
    seconds), interpolated linearly between the sizes measured and extended past the ends along
    the nearest two points' line. What the checks at 2-16 processes predict from (a line of
    ``latency`` and ``busbw``, ``fit_link``, misses gloo's small and large messages by up to half:
    they take different paths); ``fit`` is that line, for the constants' table."""

    points: tuple[tuple[float, float], ...]
    fit: Link

    @property
    def latency(self) -> float:
        return self.fit.latency

    @property
    def busbw(self) -> float:
        return self.fit.busbw

    def seconds(self, kind: str, size: float, group: int, tree: bool = False) -> float:
        if group <= 1:
            return 0.0
        pts = sorted(self.points)
        if len(pts) == 1:
            return pts[0][1] * size / pts[0][0]
        i = 1
        while i < len(pts) - 1 and pts[i][0] < size:
            i += 1
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        return max(0.0, t0 + (t1 - t0) * (size - b0) / (b1 - b0))


def measured_link(kind: str, n: int, points: Sequence[tuple[float, float]]) -> MeasuredLink:
    """The timed ``points`` of one collective on ``n`` ranks, with the line ``fit_link`` draws."""
    return MeasuredLink(tuple((float(b), float(t)) for b, t in points), fit_link(kind, n, points))


@dataclass(frozen=True)
class Fabric:
    """The constants that turn a step's collectives and copies into seconds. ``links`` per kind
    (``all_gather_list`` falls back to ``all_gather``, any other to ``all_reduce``); ``inter``:
    the links between nodes, for groups larger than ``per_node``; ``copy_bw``: local memory
    (bytes a second copied, a fresh buffer's page faults included); ``tree``: all-reduce latency
    as NCCL's tree (log N hops); ``source``: where the figures come from."""

    name: str
    links: Mapping[str, Link | MeasuredLink]
    copy_bw: float = math.inf
    inter: Mapping[str, Link | MeasuredLink] | None = None
    per_node: int = 1 << 30
    tree: bool = False
    source: str = ""

    def link(self, kind: str, group: int) -> Link | MeasuredLink:
        table = self.inter if self.inter is not None and group > self.per_node else self.links
        for k in (kind, "all_gather_list" if kind == "all_gather_fresh" else kind,
                  "all_gather" if kind.startswith("all_gather") else kind, "all_reduce"):  # fmt: skip
            if k in table:
                return table[k]
        raise KeyError(f"{self.name}: no link for {kind}")

    def seconds(self, c: Collective) -> float:
        """``c``'s seconds. A group wider than a node is hierarchical, as NCCL's rings and trees
        are: its latency is the hops between nodes at the inter-node latency plus the hops in a
        node at the intra-node one, its bandwidth the inter-node link's; an all-to-all posts one
        message to each peer (its link's latency each)."""
        link = self.link(c.kind, c.group)
        if self.inter is None or c.group <= self.per_node or c.kind == "all_to_all":
            return c.count * link.seconds(c.kind, c.size, c.group, self.tree)
        nodes = math.ceil(c.group / self.per_node)
        latency = hops(c.kind, nodes, self.tree) * link.latency
        latency += hops(c.kind, self.per_node, self.tree) * self.links.get(c.kind, self.links["all_reduce"]).latency
        return c.count * (latency + sent_fraction(c.kind, c.group) * c.size / link.busbw)


def fit_link(kind: str, n: int, points: Sequence[tuple[float, float]]) -> Link:
    """The latency and bus bandwidth that fit ``(bytes of the whole tensor, seconds)`` points of
    one collective on ``n`` ranks best in relative error (each point weighted by 1/t): the
    least-squares line ``t = hops * latency + sent / busbw``."""
    xs = [sent_fraction(kind, n) * b for b, _ in points]
    ts = [t for _, t in points]
    w = [1 / t**2 for t in ts]
    sw, sx, st = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * t for wi, t in zip(w, ts))
    sxx, sxt = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * t for wi, x, t in zip(w, xs, ts))
    slope = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    intercept = (st - slope * sx) / sw
    if slope <= 0:  # no size effect measured: all latency
        slope = 1e-15
    return Link(max(intercept, 0.0) / max(hops(kind, n), 1.0), 1.0 / slope)


# --- published figures (not measured here) ------------------------------------------------------

#: NVIDIA H100 SXM: bf16 dense tensor-core peak 989 TFLOP/s, 80 GB HBM3; H200: the same compute,
#: 141 GB HBM3e (NVIDIA's datasheets). TPU v5p: 459 TFLOP/s bf16, 95 GB HBM, ICI 1,200 GB/s a chip
#: bidirectional (Google Cloud's TPU v5p page).
H100 = {"flops": 989e12, "hbm": 80e9}
H200 = {"flops": 989e12, "hbm": 141e9}
TPU_V5P = {"flops": 459e12, "hbm": 95e9}


def nccl_fabric(per_node: int = 8, intra_busbw: float = 450e9, inter_busbw: float = 45e9,
                intra_latency: float = 5e-6, inter_latency: float = 10e-6, a2a_latency: float = 1e-6) -> Fabric:  # fmt: skip
    """NCCL on H100/H200 nodes of 8 GPUs: NVLink 4 / NVSwitch inside a node, nccl-tests' reported
    all-reduce busbw 460-480 GB/s on 8 x H100 SXM (450 taken); between nodes one 400 Gb/s NDR
    InfiniBand port a GPU, 50 GB/s line rate (45 taken: 90%). Published figures, not measured
    here. Latencies a hop (5 us in a node, 10 us across; 1 us for each message an all-to-all
    posts) are assumptions of the order nccl-tests' small messages show; the tree gives the
    all-reduce 2 log2 N of them, the rings of the others N - 1 (hierarchical: see ``seconds``)."""
    intra = Link(intra_latency, intra_busbw)
    inter = Link(inter_latency, inter_busbw)
    return Fabric("NCCL, H100/H200 (published busbw)",
                  {"all_reduce": intra, "all_to_all": Link(a2a_latency, intra_busbw)}, copy_bw=3e12,
                  inter={"all_reduce": inter, "all_to_all": Link(a2a_latency, inter_busbw)}, per_node=per_node, tree=True,
                  source="nccl-tests busbw 460-480 GB/s on 8 x H100 SXM (NVLink 4); 400 Gb/s NDR IB a GPU")  # fmt: skip


def tpu_fabric() -> Fabric:
    """TPU v5p's ICI: 1,200 GB/s a chip bidirectional (Google's figure), 600 GB/s each way, of
    which a ring uses what its torus dimension gives; 300 GB/s taken. Not measured here."""
    link = Link(5e-6, 300e9)
    return Fabric("TPU v5p ICI (published)", {"all_reduce": link}, copy_bw=2.7e12, tree=True,
                  source="Cloud TPU v5p: ICI 1,200 GB/s per chip bidirectional")  # fmt: skip


# --- workloads ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """A transformer's shape: ``params`` in all, ``root`` of them outside the ``layers`` blocks
    (embeddings, head: FSDP's root unit), ``width``, ``heads``, ``seq`` tokens a row."""

    name: str
    params: int
    layers: int
    width: int
    heads: int
    seq: int
    root: int

    @property
    def flops_per_token(self) -> float:
        """A training step's FLOPs a token: 6P + 12 L d T (nanoGPT's ``estimate_mfu``, PaLM's)."""
        return 6 * self.params + 12 * self.layers * self.width * self.seq

    @property
    def activation_bytes_per_token(self) -> float:
        """Activations kept for backward, bf16 with fused attention: 34 d a layer a token
        (Korthikanti et al. 2022, without the attention scores' 5 a s / d)."""
        return 34 * self.width * self.layers

    def activation_bytes(self, tokens: float) -> float:
        """The activations of one boundary between blocks, bf16 (what tensor and pipeline
        parallelism move): tokens x width x 2."""
        return 2 * tokens * self.width


#: nanoGPT's GPT-2 small (vocab 50,304, block 1,024; the head tied to the embedding)
NANOGPT_124M = Model("nanoGPT-124M", 124_475_904, 12, 768, 12, 1024, 50304 * 768 + 1024 * 768 + 1536)
#: a 7B decoder of Llama 2's shape (32 layers, width 4,096, 32 heads, untied head), 4,096 tokens
LLAMA_7B = Model("7B (Llama-2 shape)", 6_738_415_616, 32, 4096, 32, 4096, 2 * 32000 * 4096 + 4096)


# --- a step's costs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreCosts:
    """Store calls: each rank's and the job's a second (the control plane, no fault), the job's
    at start-up, and a step's (none: no training step calls the store)."""

    per_rank_per_second: float
    job_per_second: float
    startup_job: float
    per_step: float = 0.0


@dataclass(frozen=True)
class Costs:
    """One optimizer step of ``strategy`` on ``n`` ranks: ``collectives`` (with bytes and
    groups), ``memory`` per rank by kind (bytes), ``store`` calls, ``copied`` (bytes a rank copies
    locally for the exchange), ``bubble`` (a pipeline's idle share), ``rows`` of the global batch
    a rank computes, ``compute_share`` (of those rows' FLOPs: 1/T under tensor parallelism, 1/K a
    stage), ``window`` (the share of the compute the collectives marked hidden can overlap on an
    accelerator: backward's 2/3; the last piece's under the deterministic mode), ``served``
    (bytes each parameter server serves a step), ``notes`` (what the numbers rest on)."""

    strategy: str
    n: int
    params: int
    batch: int
    collectives: tuple[Collective, ...]
    memory: Mapping[str, float]
    store: StoreCosts
    copied: float = 0.0
    bubble: float = 0.0
    rows: float = 0.0
    compute_share: float = 1.0
    window: float = 2 / 3
    served: float = 0.0
    notes: tuple[str, ...] = ()

    @property
    def sent_per_rank(self) -> float:
        """Bytes a rank sends in one step."""
        return sum(c.sent for c in self.collectives)

    @property
    def collectives_per_step(self) -> float:
        return sum(c.count for c in self.collectives)

    @property
    def memory_per_rank(self) -> float:
        return sum(self.memory.values())

    def comm_seconds(self, fabric: Fabric, hidden: bool | None = None) -> float:
        """Seconds of the step's collectives (``hidden``: only those started during compute, or
        only the others), plus the local copies at ``fabric.copy_bw``."""
        t = sum(fabric.seconds(c) for c in self.collectives if hidden is None or c.hidden == hidden)
        return t + (self.copied / fabric.copy_bw if hidden is not True else 0.0)


def _buckets(nbytes: float, first: float = 1 * MB, cap: float = 25 * MB) -> list[float]:
    """The reducer's bucket sizes for ``nbytes`` of gradient (``comm/buckets.py``: the first at
    ``first``, then ``cap``), as if parameters were small beside a bucket."""
    out, left = [], nbytes
    for c in (first, *([cap] * int(math.ceil(max(0.0, nbytes - first) / cap)))):
        if left <= 0:
            break
        out.append(min(c, left))
        left -= c
    return out


def _control_plane(n: int) -> StoreCosts:
    beats = 1.0  # heartbeat_seconds = 1 (the default)
    return StoreCosts(CALLS_PER_BEAT_PER_RANK / beats, (CALLS_PER_BEAT_PER_RANK * n + WATCHER_CALLS_PER_BEAT) / beats,
                      STARTUP_CALLS_PER_RANK * n)  # fmt: skip


def deterministic_blocks(n: int, batch: int, piece: int) -> tuple[int, int]:
    """(the most blocks a replica holds, every replica's blocks) when each of ``n`` replicas holds
    ``batch / (piece n)`` pieces of the global batch (``core/canonical.blocks``)."""
    local = batch // (piece * n)
    held = [len(blocks(r * local, (r + 1) * local)) for r in range(n)]
    return max(held), sum(held)


# --- the library's exchanges, from real sizes ----------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """One step's gradient exchange as the library does it: its collectives and the bytes it
    copies locally (into buffers made for the step or kept: a fresh buffer's pages are faulted in
    as it is written, which ``Fabric.copy_bw`` counts)."""

    collectives: tuple[Collective, ...]
    copied: float

    def seconds(self, fabric: Fabric) -> float:
        return sum(fabric.seconds(c) for c in self.collectives) + self.copied / fabric.copy_bw


def reducer_exchange(bucket_bytes: Sequence[float], n: int, flags: bool = True) -> Exchange:
    """The default mode's reducer (``comm/reducer.py``): each bucket flat (its gradients copied in,
    a flag a parameter), all-reduced during backward, copied back out. One rank: nothing."""
    if n <= 1:
        return Exchange((), 0.0)
    colls = tuple(Collective("all_reduce", b, n, hidden=True, what="a bucket, during backward") for b in bucket_bytes)
    return Exchange(colls, 2 * sum(bucket_bytes) if flags else 0.0)


def blocks_exchange(bucket_bytes: Sequence[float], n: int, k: int = 1, K: int | None = None, *, fresh: bool = True) -> Exchange:
    """The deterministic mode's sliced exchange (``comm/blocks.py``) of buckets (``reduce_blocks``:
    one a dtype; fit's ``OverlappedExchange``: the reducer's buckets) when a replica holds ``k``
    blocks and all replicas ``K`` (default ``k n``): per bucket an all-to-all of the ``k`` block
    sums of each replica's slice and an all-gather of the finished slices. Copied: the block sums
    into the send buffer, the slice's tree, the root; ``fresh`` (``reduce_blocks``, made each
    call): also the send buffer zeroed and the received blocks (its gather into tensors made for
    the call and their concatenation are timed whole, ``all_gather_fresh``). One replica: nothing but the tree (``reduce_blocks`` combines its own)."""
    if n <= 1:
        return Exchange((), 0.0)
    K = k * n if K is None else K
    colls: list[Collective] = []
    copied = 0.0
    for b in bucket_bytes:
        width = math.ceil(b / 4 / n) * 4
        colls.append(Collective("all_to_all", k * width * n, n, hidden=True, what="a bucket's block sums"))
        # reduce_blocks gathers into tensors made for the call and concatenates them (timed as
        # one kind, "all_gather_fresh"); fit's exchange into buffers it keeps
        gather = "all_gather_fresh" if fresh else "all_gather_list"
        colls.append(Collective(gather, width * n, n, what="a bucket's finished slices, after backward"))
        copied += (k + (K - 1) / n + 1) * width * n
        if fresh:
            copied += (k + K / n) * width * n
    return Exchange(tuple(colls), copied)


def fsdp_exchange(unit_bytes: Sequence[float], n: int, root_bytes: float = 0.0, grad_ratio: float = 1.0) -> Exchange:
    """FSDP2 over ``n`` ranks (``ShardedStrategy``): each unit's weights all-gathered in forward and
    again in backward (resharded after forward), the root's once (kept); each unit's gradient
    reduce-scattered (``grad_ratio``: gradient bytes over gathered bytes, 2 under bf16 gathers
    with fp32 reduction). Copied: each all-gather's output out of its flat buffer, each
    reduce-scatter's input into one. One rank: nothing (FSDP2 on one rank gathers nothing)."""
    if n <= 1:
        return Exchange((), 0.0)
    colls: list[Collective] = []
    for u in unit_bytes:
        colls.append(Collective("all_gather", u, n, count=2, hidden=True, what="a unit's weights, forward and backward"))
        colls.append(Collective("reduce_scatter", u * grad_ratio, n, hidden=True, what="a unit's gradient"))
    if root_bytes:
        colls.append(Collective("all_gather", root_bytes, n, what="the root's weights, kept to backward"))
        colls.append(Collective("reduce_scatter", root_bytes * grad_ratio, n, what="the root's gradient, after backward"))
    total = sum(unit_bytes)
    return Exchange(tuple(colls), 2 * total + root_bytes + (total + root_bytes) * grad_ratio)


def costs(
    strategy: str, n: int, params: int, batch: int, *, model: Model | None = None,
    grad_bytes: int = 4, param_bytes: int = 4, optimizer_bytes: int = 8, gather_bytes: int | None = None,
    piece: int = 32, shard_size: int = 8, tensor: int = 8, stages: int = 4, micro: int | None = None,
    micro_rows: float | None = None,
    ps_tasks: int = 1, units: int | None = None, first_bucket: float = 1 * MB, bucket_cap: float = 25 * MB,
    tokens_per_row: int = 1,
) -> Costs:  # fmt: skip
    """One optimizer step of ``strategy`` on ``n`` ranks, ``params`` parameters, ``batch`` rows
    in the global batch (``tokens_per_row`` tokens each, for activations). Bytes a parameter:
    ``param_bytes`` (the weights), ``grad_bytes`` (the gradient, as reduced), ``optimizer_bytes``
    (AdamW's two fp32 moments: 8), ``gather_bytes`` (what FSDP gathers: bf16 under mixed
    precision; default the weights'). ``model`` gives the units, layers and activations;
    ``micro_rows``: the rows one forward holds at once (a micro-step of gradient accumulation, a
    pipeline's micro-batch; default all of a rank's rows).

    Per strategy (every term in docs/SCALE.md, "The cost model"):

    - ``mirrored`` / ``multiworker``: the reducer's buckets all-reduced during backward.
    - ``deterministic``: pieces of ``piece`` rows; per bucket an all-to-all of the block sums
      (k a replica) and an all-gather of the finished slices (``comm/blocks.py``).
    - ``failover``: ``on_failure="continue"``: one all-reduce of the whole gradient after backward.
    - ``sharded``: FSDP2, a unit a layer and the root: all-gather forward and backward (the root's
      kept), reduce-scatter.
    - ``hsdp``: sharded within groups of ``shard_size``, all-reduce of the shards across groups.
    - ``tensor``: ``tensor``-way tensor parallel (4 all-reduces of a block's activations a block),
      FSDP over the ``n / tensor`` data replicas.
    - ``pipeline``: ``stages`` stages, ``micro`` micro-batches (1F1B; default a copy's rows over
      ``micro_rows``, else 8), ``n / stages`` copies whose
      stage gradients are all-reduced.
    - ``ps``: ``n`` workers and ``ps_tasks`` parameter servers: each worker pulls the weights and
      pushes its gradient every step.
    - ``tpu``: XLA SPMD, the gradient all-reduced over ICI (one process a host of 4 chips).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    if n < 1 or params < 1 or batch < 1:
        raise ValueError(f"costs: n, params and batch must be positive, got n={n}, params={params}, batch={batch}")
    gather_bytes = param_bytes if gather_bytes is None else gather_bytes
    P, G = float(params), float(params) * grad_bytes
    state = P * (param_bytes + grad_bytes + optimizer_bytes)
    store = _control_plane(n)
    rows = batch / n
    act_token = model.activation_bytes_per_token if model is not None else 0.0

    def held(r: float) -> float:  # the rows whose activations one forward keeps
        return min(r, micro_rows) if micro_rows is not None else r
    layers = model.layers if model is not None else (units or 1)
    notes: list[str] = []
    colls: list[Collective] = []
    memory: dict[str, float] = {}
    copied = bubble = served = 0.0
    share, window = 1.0, 2 / 3
    if strategy in ("mirrored", "multiworker", "failover", "tpu"):
        if strategy == "failover":
            colls.append(Collective("all_reduce", G, n, what="the flat gradient, after backward"))
            memory["exchange buffers"] = G
        else:
            ex = reducer_exchange(_buckets(G, first_bucket, bucket_cap), n)
            colls.extend(ex.collectives)
            memory["exchange buffers"] = G  # the reducer's flat buckets, kept between steps
            copied = ex.copied  # each gradient into its bucket and back
        memory["weights, gradients, optimizer"] = state
        memory["activations"] = act_token * held(rows) * tokens_per_row
        if strategy == "tpu":
            notes.append("one process a host drives its chips (XLA SPMD); no stratagem store: PJRT's runtime meets the hosts")
            store = StoreCosts(0.0, 0.0, 0.0)
            copied = 0.0
    elif strategy == "deterministic":
        if batch % (piece * n):
            raise ValueError(f"deterministic: the global batch {batch} is not a multiple of piece {piece} x {n} replicas")
        local = batch // (piece * n)
        k, K = deterministic_blocks(n, batch, piece)
        ex = blocks_exchange(_buckets(G, first_bucket, bucket_cap), n, k, K, fresh=False)
        colls.extend(ex.collectives)
        # the pieces' gradients held until the last piece, the send buffer (k blocks), every
        # replica's blocks of this slice, the gathered root
        memory["weights, gradients, optimizer"] = state
        memory["pieces' gradients"] = max(0, local - 1) * G
        memory["exchange buffers"] = (k + K / n + 1) * G
        memory["activations"] = act_token * piece * tokens_per_row
        copied = ex.copied  # into the send buffer, the slice's tree, the root out
        window = 2 / 3 / max(local, 1)  # the all-to-alls start during the last piece's backward
        notes.append(f"{local} pieces a replica, {k} block{'s' if k > 1 else ''} (k); sent (k+1)(N-1)/N of the gradient")
        if k > 1:
            notes.append(f"{local} pieces a replica is not a power of two: {k} blocks, {(k + 1) / 2:.2f}x the all-reduce's bytes")
    elif strategy in ("sharded", "hsdp"):
        s = n if strategy == "sharded" else min(shard_size, n)
        groups = n // s
        u = units if units is not None else layers
        root = float(model.root) if model is not None else 0.0
        unit = (P - root) / max(u, 1)
        ex = fsdp_exchange([unit * gather_bytes] * max(u, 1), s, root * gather_bytes, grad_bytes / gather_bytes)
        colls.extend(ex.collectives)
        if groups > 1:
            colls.append(Collective("all_reduce", G / s, groups, hidden=True, what="the shards' gradients across groups"))
        memory["weights, gradients, optimizer"] = state / s
        memory["gathered units"] = 2 * unit * (gather_bytes + grad_bytes) + root * (gather_bytes + grad_bytes)
        memory["activations"] = act_token * held(rows) * tokens_per_row
        copied = ex.copied  # FSDP2's copy-out of each all-gather, copy-in of the reduce-scatter
        window = 1.0  # the next unit's all-gather is prefetched in forward as in backward
    elif strategy == "tensor":
        t = min(tensor, n)
        d = max(1, n // t)
        rows = batch / d
        share = 1.0 / t
        P_split = P - (model.root if model is not None else 0.0)
        act = model.activation_bytes(held(rows) * tokens_per_row) if model is not None else 0.0
        steps = max(1.0, rows / held(rows))  # micro-steps of gradient accumulation
        colls.append(Collective("all_reduce", act, t, count=4 * layers * steps, what="a block's activations (2 forward, 2 backward)"))
        if d > 1:
            for kind, size in (("all_gather", 2 * P_split / t * gather_bytes), ("reduce_scatter", P_split / t * grad_bytes)):
                colls.append(Collective(kind, size, d, hidden=True, what="FSDP over the data axis"))
            colls.append(Collective("all_reduce", (P - P_split) * grad_bytes, d, hidden=True, what="the replicated weights' gradient"))
        window = 1.0
        memory["weights, gradients, optimizer"] = state * (P_split / (t * d) + (P - P_split) / d) / P
        memory["activations"] = act_token * held(rows) * tokens_per_row * (0.5 + 0.5 / t)
        notes.append(f"{t}-way tensor parallel x {d} data replicas")
    elif strategy == "pipeline":
        k = min(stages, n)
        c = max(1, n // k)
        rows = batch / c
        share = 1.0 / k
        if micro is None:
            micro = max(1, int(rows // micro_rows)) if micro_rows is not None else 8
        mb_rows = rows / micro
        act = model.activation_bytes(mb_rows * tokens_per_row) if model is not None else 0.0
        colls.append(Collective("send", act, 2, count=2 * micro, what="a micro-batch's activations forward, gradient back"))
        if c > 1:
            colls.append(Collective("all_reduce", G / k, c, hidden=True, what="a stage's gradient across copies"))
        bubble = (k - 1) / (micro + k - 1)
        window = 2 / 3 / micro  # a stage's all-reduce starts during its last micro-batch's backward
        memory["weights, gradients, optimizer"] = state / k + G / k
        memory["activations"] = act_token / k * mb_rows * tokens_per_row * min(micro, k)
        notes.append(f"{k} stages x {c} copies, {micro} micro-batches (1F1B): bubble {bubble:.0%}")
    elif strategy == "ps":
        colls.append(Collective("send", P * param_bytes, 2, what="the weights pulled from the ps tasks"))
        colls.append(Collective("send", G, 2, what="the gradient pushed to the ps tasks"))
        memory["weights, gradients"] = P * param_bytes + G
        memory["activations"] = act_token * held(rows) * tokens_per_row
        memory["on each ps task: weights, optimizer"] = (P * (param_bytes + optimizer_bytes)) / ps_tasks
        served = n * (P * param_bytes + G) / ps_tasks
        window = 0.0
        notes.append(f"each ps task serves {served / GB:.1f} GB a step of the workers (all {n} of them)")
        calls = PS_BEATS_PER_SECOND * (5 * n + 1 + 3 * (n + ps_tasks))
        store = StoreCosts(PS_BEATS_PER_SECOND * 5, calls, 3 * (n + ps_tasks))
    return Costs(strategy, n, params, batch, tuple(colls), memory, store, copied, bubble, rows, share, window,
                 served, tuple(notes))  # fmt: skip


# --- predictions on accelerators ----------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """A step's seconds: ``compute`` (the rank's share of the FLOPs at the assumed MFU, stretched
    by the bubble), ``comm`` (every collective and copy), ``exposed`` (what compute does not
    hide), ``step``; ``efficiency``: the compute a perfectly scaling job would spend / ``step``."""

    costs: Costs
    compute: float
    comm: float
    exposed: float
    step: float
    efficiency: float
    limits: tuple[str, ...] = field(default=())


def predict(
    c: Costs, fabric: Fabric, model: Model, *, flops: float, mfu: float = 0.4, hbm: float = math.inf,
    store_rate: float = 75_000.0, ps_bandwidth: float = 12.5e9,
) -> Prediction:  # fmt: skip
    """The step of ``c`` on accelerators of ``flops`` peak at ``mfu``: compute the rank's share
    of ``model.flops_per_token`` over its tokens; collectives marked hidden overlap up to
    ``c.window`` of the compute, the others add; a parameter server's links serve ``c.served``
    bytes a step at ``ps_bandwidth``. ``limits``: what breaks, most severe first."""
    tokens = c.rows * model.seq
    ideal = model.flops_per_token * tokens * c.compute_share / (flops * mfu)
    compute = ideal / (1 - c.bubble) if c.bubble else ideal
    hidden, plain = c.comm_seconds(fabric, hidden=True), c.comm_seconds(fabric, hidden=False)
    exposed = plain + max(0.0, hidden - c.window * ideal)
    if c.served:  # asynchronous: a worker's own pace, or the ps tasks' links, whichever is slower
        exposed = max(exposed, c.served / ps_bandwidth - ideal)
    step = compute + exposed
    return Prediction(c, compute, hidden + plain, exposed, step, ideal / step, limits(c, fabric, hbm=hbm, store_rate=store_rate))


def limits(c: Costs, fabric: Fabric | None = None, *, hbm: float = math.inf, store_rate: float = 75_000.0) -> tuple[str, ...]:
    """What breaks at this scale, most severe first: memory, a batch too small to split, the
    store's rate, latency-bound collectives, the bubble."""
    out = []
    if c.memory_per_rank > hbm:
        out.append(f"memory: {c.memory_per_rank / GB:.0f} GB a rank > {hbm / GB:.0f} GB")
    if c.rows < 1:
        out.append(f"batch: {c.batch} rows over {c.n} ranks is {c.rows:.2f} a rank")
    if c.store.job_per_second > store_rate:
        out.append(f"store: {c.store.job_per_second:,.0f} calls/s > {store_rate:,.0f}")
    for col in c.collectives:
        part = col.size / max(col.group, 1)
        if col.group > 64 and col.kind in ("all_gather", "all_gather_list", "reduce_scatter", "all_to_all") and part < 256 * 1024:
            out.append(f"latency: {col.kind} of {col.what} in {part / 1024:.0f} KB parts over {col.group} ranks ({col.group - 1} hops)")
            break
    if c.bubble > 0.25:
        out.append(f"bubble: {c.bubble:.0%} of the step idle")
    return tuple(out)

