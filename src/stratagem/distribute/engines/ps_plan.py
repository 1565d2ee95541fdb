"""Where parameter-server variables live (pure): each variable whole on one ps task, round-robin
in creation order as tf.distribute places them, or split into row shards over consecutive tasks
when the variable partitioner asks for more than one shard."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stratagem.distribute.partitioners import shard_bounds


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, stop)`` of variable ``vid`` held by ps task ``ps`` under key ``key``."""

    key: str
    ps: int
    start: int
    stop: int


@dataclass(frozen=True)
class VariablePlan:
    """One variable: its id, shape, dtype, whether reads go row by row (an embedding table), and
    its shards (one shard holding every row when it is not partitioned)."""

    vid: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: bool
    shards: tuple[Shard, ...]

    @property
    def partitioned(self) -> bool:
        return len(self.shards) > 1

    def __str__(self) -> str:
        where = " ".join(f"ps{s.ps}[{s.start}:{s.stop}]" for s in self.shards)
        return f"{self.name}{list(self.shape)} -> {where}"


Partitioner = Callable[[Sequence[int], torch.dtype], Sequence[int]]


def plan_variables(
    variables: Sequence[tuple[str, tuple[int, ...], torch.dtype, bool]],
    num_ps: int,
    partitioner: Partitioner | None,
    first_vid: int = 0,
    first_task: int = 0,
) -> list[VariablePlan]:
    """Place ``(name, shape, dtype, rows)`` variables on ``num_ps`` tasks.

    Whole variables go round-robin over the tasks in order; a variable the partitioner splits
    into k > 1 shards (axis 0 only, as tf) puts shard i on the next task in the same rotation.
    Ids start at ``first_vid`` and the rotation at task ``first_task`` (a later scope goes on
    where the previous one stopped)."""
    if num_ps < 1:
        raise ValueError(f"a parameter-server cluster needs at least one ps task, got {num_ps}")
    plans: list[VariablePlan] = []
    nxt = first_task
    for vid, (name, shape, dtype, rows) in enumerate(variables, start=first_vid):
        parts = [1] * len(shape)
        if partitioner is not None and len(shape) > 0:
            parts = list(partitioner(shape, dtype))
        if len(parts) != len(shape) or any(p < 1 for p in parts) or any(p != 1 for p in parts[1:]):
            raise ValueError(
                f"the variable partitioner returned {parts} for {name} of shape {list(shape)}; "
                "expected one count per axis, all 1 except axis 0"
            )
        k = min(parts[0], shape[0]) if shape else 1
        shards = []
        for i, (start, stop) in enumerate(shard_bounds(shape[0], k) if shape else [(0, 0)]):
            shards.append(Shard(f"{vid}/{i}", nxt % num_ps, start, stop))
            nxt += 1
        plans.append(VariablePlan(vid, name, tuple(shape), dtype, rows, tuple(shards)))
    return plans
