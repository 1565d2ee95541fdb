"""Re-materialization: which micro-batches are recomputed (torchgpipe's modes, and ``"auto"``, which
keeps activations where they fit a memory budget) and the RNG and buffer bookkeeping that makes a
recomputed forward identical to the first one."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MODES = ("auto", "always", "except_last", "never")

#: the share of the memory found available that ``"auto"`` lets a step's kept activations take
AUTO_BUDGET_SHARE = 0.5

_log = logging.getLogger("stratagem.pipeline")


def rematerialize_stop(mode: str, num_microbatches: int) -> int:
    """Micro-batches ``i < stop`` are recomputed in backward (torchgpipe's ``rematerialize_stop``).
    ``"auto"`` has no fixed stop: ``AutoRematerialize`` chooses one per step."""
    if mode == "auto":
        raise ValueError("rematerialize='auto' chooses its stop per step: use AutoRematerialize")
    if mode == "always":
        return num_microbatches
    if mode == "except_last":
        return num_microbatches - 1
    if mode == "never":
        return 0
    raise ValueError(f"rematerialize must be one of {MODES}, got {mode!r}")


@dataclass(frozen=True)
class RNGSnapshot:
    """The CPU generator state, and the CUDA one of ``device`` when it is a GPU."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> RNGSnapshot:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)


@contextlib.contextmanager
def replay_rng(state: RNGSnapshot) -> Iterator[None]:
    """Run the body with the RNG as it was at ``state``; restore the current state afterwards
    (like torch.utils.checkpoint's ``preserve_rng_state``)."""
    devices = [state.device] if state.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state.cpu)
        if state.cuda is not None:
            torch.cuda.set_rng_state(state.cuda, state.device)
        yield


@contextlib.contextmanager
def frozen_buffers(module: nn.Module) -> Iterator[None]:
    """Let the body update copies of the buffers, then put the originals back (BatchNorm running
    statistics are updated once per micro-batch, in its first forward, not again when it is
    recomputed; the originals are never written, so autograd's saved tensors stay valid)."""
    swapped = []
    for m in module.modules():
        for k, b in list(m._buffers.items()):
            if b is not None:
                swapped.append((m, k, b))
                m._buffers[k] = b.clone()
    try:
        yield
    finally:
        for m, k, b in swapped:
            m._buffers[k] = b


def available_memory(device: torch.device) -> int | None:
    """Bytes this process may still allocate on ``device`` (None: unknown). A GPU's free memory
    plus what torch's caching allocator holds unused; on the CPU, the machine's ``MemAvailable``
    shared among this machine's processes of the job (``LOCAL_WORLD_SIZE``)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def peak_kept(actions: Sequence[Any], stop: int, per_microbatch: Sequence[float], chunks: int) -> float:
    """The most activation bytes this rank holds at once over ``actions`` (its part of a schedule)
    when micro-batches ``i < stop`` are recomputed: a kept micro-batch holds its chunk's share of
    ``per_microbatch[i]`` from its forward to its backward (to its weight pass under a split
    backward); a recomputed one from its backward's recomputation to the same point."""
    weight_pass = {(a.chunk, a.microbatch) for a in actions if a.kind == "W"}
    held = peak = 0.0
    for a in actions:
        share = per_microbatch[a.microbatch] / chunks
        kept = a.microbatch >= stop
        if a.kind == "F":
            held += share if kept else 0.0
        elif a.kind in ("B", "I"):
            if not kept:
                held += share
            peak = max(peak, held)
            if (a.chunk, a.microbatch) not in weight_pass:
                held -= share
        elif a.kind == "W":
            held -= share
        peak = max(peak, held)
    return peak


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t``'s storage starts and its bytes; a tensor without a live storage of its own (a
    freed or resharded one, a subclass) counts by identity and its own size."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t), t.numel() * t.element_size()


class AutoRematerialize:
    """``rematerialize="auto"``: keep every micro-batch's activations when they fit the budget,
    else recompute the fewest micro-batches that makes them fit.

    The first step runs as ``"except_last"`` and measures the bytes autograd saves per example
    on this rank (every forward with grad: the last micro-batch's and the recomputed ones; the
    parameters excluded). From then on each step's stop is the smallest whose peak of kept
    activations over this rank's actions (``peak_kept``) stays within ``AUTO_BUDGET_SHARE`` of
    the memory available after the first step (``available_memory``). Each rank decides for its
    own stage: a recomputation is local to it, and recomputing gives the same values (RNG
    replayed), so the choice changes memory and time, never results. The choice and its estimate
    go to the ``stratagem.pipeline`` logger at INFO level."""

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        *,
        stage: int,
        budget: Callable[[torch.device], int | None] = available_memory,
    ) -> None:
        self.module = module
        self.device = device
        self.stage = stage
        self._budget = budget
        self.bytes_per_example: float | None = None
        self.budget_bytes: float | None = None
        self._stops: dict[tuple[int, ...], int] = {}  # by micro-batch sizes: decided once each

    @property
    def measured(self) -> bool:
        return self.bytes_per_example is not None

    def stop(self, actions: Sequence[Any], sizes: Sequence[int], chunks: int) -> int:
        """The stop for a step over micro-batches of ``sizes`` on this rank's ``actions``."""
        m = len(sizes)
        if self.bytes_per_example is None or self.budget_bytes is None:
            # the first step (torchgpipe's default, while measuring), or memory that cannot be read
            return m - 1
        key = tuple(sizes)
        if key not in self._stops:
            per_mb = [self.bytes_per_example * n for n in sizes]
            stop = next(
                (s for s in range(m + 1) if peak_kept(actions, s, per_mb, chunks) <= self.budget_bytes), m
            )
            self._stops[key] = stop
            _log.info(
                "stage %d: rematerialize='auto' keeps micro-batches %d..%d of %d (%.1f MiB of "
                "activations per micro-batch of %d examples; peak %.1f MiB against a budget of %.1f MiB)",
                self.stage, stop, m - 1, m, per_mb[0] / 2**20, sizes[0],
                peak_kept(actions, stop, per_mb, chunks) / 2**20, self.budget_bytes / 2**20,
            )  # fmt: skip
        return self._stops[key]

    @contextlib.contextmanager
    def measuring(self, sizes: Sequence[int]) -> Iterator[None]:
        """Around the first step (run with ``stop`` = M - 1): count the bytes autograd saves."""
        if self.measured:
            yield
            return
        # (a sharded layer's parameters are resharded between its uses: their storage may be freed)
        params = {_storage(p)[0] for p in self.module.parameters() if p.device.type != "meta"}
        seen: set[int] = set()
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr, nbytes = _storage(t)
            if ptr not in params and ptr not in seen and not (t.is_leaf and t.requires_grad):
                seen.add(ptr)
                total[0] += nbytes
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        examples = sum(sizes)
        self.bytes_per_example = total[0] / max(1, examples)
        available = self._budget(self.device)
        self.budget_bytes = AUTO_BUDGET_SHARE * available if available is not None else None
        if available is None:
            _log.info("stage %d: rematerialize='auto' cannot read the memory available on %s; "
                      "it recomputes all micro-batches but the last", self.stage, self.device)
