"""The whole tensor of a DTensor, one mesh axis at a time."""

from __future__ import annotations

import sys
from typing import Any


def whole_tensor(t: Any) -> Any:
    """``t``, or the whole tensor of a DTensor (a collective over its mesh: every process holding
    a part calls it, in the same order), gathered one mesh axis at a time. (torch's
    ``full_tensor`` gathers a layout split along two axes, FSDP x TP's strided shard, by several
    sequential all-gathers in one call, and logs a warning each time it does.)"""
    if "torch.distributed.tensor" not in sys.modules:
        return t
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return t
    placements = list(t.placements)
    for i, p in enumerate(placements):
        if not p.is_replicate():
            placements[i] = Replicate()
            t = t.redistribute(t.device_mesh, placements)
    return t.to_local()
