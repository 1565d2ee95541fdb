"""Balancing as data: split per-layer costs into contiguous blocks, one per stage, minimizing the
largest block's cost; the resulting ``Partition`` prints which layers each stage holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def block_partition(costs: Sequence[float], num_parts: int) -> list[int]:
    """Layer counts of ``num_parts`` contiguous non-empty blocks of ``costs`` whose largest sum is
    as small as possible (exact, by dynamic programming); ties prefer more even blocks, then
    earlier cuts. ``block_partition([4, 1, 1, 1, 1], 2) == [1, 4]``."""
    n = len(costs)
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if n < num_parts:
        raise ValueError(f"cannot split {n} layers into {num_parts} non-empty stages")
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be >= 0, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = (float("inf"), float("inf"))
    # best[p][j]: (max block, sum of squares) for the first j layers in p blocks; cut[p][j]: start
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0.0)
    for p in range(1, num_parts + 1):
        for j in range(p, n - (num_parts - p) + 1):
            for i in range(p - 1, j):
                prev = best[p - 1][i]
                if prev == inf:
                    continue
                seg = prefix[j] - prefix[i]
                cand = (max(prev[0], seg), prev[1] + seg * seg)
                if cand < best[p][j]:
                    best[p][j] = cand
                    cut[p][j] = i
    counts = []
    j = n
    for p in range(num_parts, 0, -1):
        i = cut[p][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """``balance`` as a list, or a PipelineConfigError saying what is wrong with it."""
    from stratagem.pipeline.errors import PipelineConfigError

    counts = list(balance)
    if len(counts) != num_stages:
        raise PipelineConfigError(
            f"balance={counts} has {len(counts)} entries but there are {num_stages} stages; "
            "give one layer count per stage"
        )
    if any(not isinstance(c, int) or c < 1 for c in counts):
        raise PipelineConfigError(
            f"balance={counts} must hold positive integers (every stage needs at least one layer)"
        )
    if sum(counts) != num_layers:
        raise PipelineConfigError(
            f"balance={counts} covers {sum(counts)} layers but the model has {num_layers} (after "
            f"flattening nested nn.Sequential); give counts that add up to {num_layers}"
        )
    return counts


@dataclass(frozen=True)
class Partition:
    """Which layers each stage holds: ``balance[s]`` consecutive layers, chosen by ``method``.
    With ``virtual_stages`` v > 1 the entries are chunks, chunk ``c`` on stage ``c % (len / v)``."""

    balance: tuple[int, ...]
    method: str
    names: tuple[str, ...] = ()
    costs: tuple[float, ...] = ()
    virtual_stages: int = 1

    @property
    def num_stages(self) -> int:
        return len(self.balance)

    def layers(self, stage: int) -> range:
        """Indices (into the flattened model) of the layers of ``stage``."""
        start = sum(self.balance[:stage])
        return range(start, start + self.balance[stage])

    def stage_costs(self) -> tuple[float, ...]:
        if not self.costs:
            return ()
        return tuple(sum(self.costs[i] for i in self.layers(s)) for s in range(self.num_stages))

    def __str__(self) -> str:
        lines = [f"partition by {self.method}: balance={list(self.balance)}"]
        costs = self.stage_costs()
        for s in range(self.num_stages):
            r = self.layers(s)
            names = [self.names[i] for i in r] if self.names else [str(i) for i in r]
            shown = names if len(names) <= 6 else [*names[:3], "...", *names[-2:]]
            cost = f"  cost {costs[s]:.4g}" if costs else ""
            ranks = len(self.balance) // self.virtual_stages
            where = f"stage {s}" if self.virtual_stages == 1 else f"chunk {s} (stage {s % ranks})"
            lines.append(f"  {where}: layers {r.start}..{r.stop - 1} [{', '.join(shown)}]{cost}")
        return "\n".join(lines)
