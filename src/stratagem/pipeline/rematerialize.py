"""Re-materialization: which micro-batches are recomputed (torchgpipe's modes) and the RNG and
buffer bookkeeping that makes a recomputed forward identical to the first one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

MODES = ("always", "except_last", "never")


def rematerialize_stop(mode: str, num_microbatches: int) -> int:
    """Micro-batches ``i < stop`` are recomputed in backward (torchgpipe's ``rematerialize_stop``)."""
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
