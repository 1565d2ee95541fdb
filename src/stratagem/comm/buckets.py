"""The bucket plan for gradient reduction: a pure function from parameter sizes to buckets.

As DDP does: parameters in the order their gradients become ready in the backward pass (before
one was seen: reverse registration order, roughly that), grouped by dtype and device, cut into
buckets of at most ``first_cap`` bytes for the first and ``cap`` bytes for the rest. Buckets are
launched in index order on every replica, so the plan must be identical everywhere (a function
of the model and of one agreed order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MB = 1024 * 1024


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know about one parameter."""

    name: str
    numel: int
    element_size: int
    dtype: str
    device: str


@dataclass(frozen=True)
class Bucket:
    """Parameters (indices into the spec list) reduced together as one flat message."""

    index: int
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: str
    device: str

    def __str__(self) -> str:
        return f"B{self.index}[{len(self.params)}p {self.numel} {self.dtype}]"


def plan_buckets(
    specs: Sequence[ParamSpec], first_cap: int = 1 * MB, cap: int = 25 * MB, order: Sequence[int] | None = None,
    cut: int | None = None,
) -> tuple[Bucket, ...]:
    """Buckets over ``specs`` (given in registration order), first bucket capped at ``first_cap``.

    ``order``: the indices of ``specs`` in the order their gradients become ready (a backward
    pass seen, as DDP rebuilds its buckets after its first iteration); default: reverse
    registration order. ``cut``: the first ``cut`` of the order and the others never share a
    bucket (the others' buckets come after)."""
    if order is None:
        order = range(len(specs) - 1, -1, -1)
    elif sorted(order) != list(range(len(specs))):
        raise ValueError(f"a bucket order must name each of the {len(specs)} parameters once, got {list(order)}")
    buckets: list[Bucket] = []
    open_: dict[tuple[str, str], list[int]] = {}
    sizes: dict[tuple[str, str], int] = {}

    def close(key: tuple[str, str]) -> None:
        idx = open_.pop(key)
        sizes.pop(key)
        offsets, total = [], 0
        for i in idx:
            offsets.append(total)
            total += specs[i].numel
        buckets.append(Bucket(len(buckets), tuple(idx), tuple(offsets), total, key[0], key[1]))

    for pos, i in enumerate(order):
        if pos == cut:
            for key in list(open_):
                close(key)
        s = specs[i]
        key = (s.dtype, s.device)
        open_.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + s.numel * s.element_size
        limit = first_cap if not buckets else cap
        if sizes[key] >= limit:
            close(key)
    for key in list(open_):
        close(key)
    return tuple(buckets)


def describe(buckets: Sequence[Bucket]) -> str:
    """One line: ``B0[2p 1024 float32] B1[...]``."""
    return " ".join(str(b) for b in buckets)
