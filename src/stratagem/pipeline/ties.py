"""Weights tied across pipeline stages (a GPT's token embedding on the first stage and its
output head, the same matrix, on the last): each stage holding an end keeps its own copy, and
after the backward of every step the copies' gradients are summed among those stages, as
Megatron-LM and GPipe implementations do, so every copy takes the same update and the tie holds
(the summed gradient is the unsplit model's gradient of the one shared parameter).

``find_ties`` is data (which names of which layers are one parameter, and on which stages);
``TiedGradients`` is its runtime (a communicator over the stages of each tie).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from stratagem.comm import Communicator


@dataclass(frozen=True)
class Tie:
    """One parameter reached under several names, from layers of more than one stage."""

    names: tuple[str, ...]  # "<layer>.<parameter path>" for every place it is registered
    layers: tuple[int, ...]  # the flattened layer of each name
    stages: tuple[int, ...]  # the stages holding an end, sorted

    def __str__(self) -> str:
        return f"{' = '.join(self.names)} (stages {', '.join(map(str, self.stages))})"


def find_ties(layers: Sequence[tuple[str, nn.Module]], stage_of_layer: Sequence[int]) -> list[Tie]:
    """The parameters shared by layers on different stages (before the stages are split)."""
    where: dict[int, list[tuple[str, int]]] = {}
    for j, (lname, layer) in enumerate(layers):
        for pname, p in layer.named_parameters(remove_duplicate=False):
            where.setdefault(id(p), []).append((f"{lname}.{pname}", j))
    ties = []
    for places in where.values():
        stages = sorted({stage_of_layer[j] for _, j in places})
        if len(stages) > 1:
            ties.append(Tie(tuple(n for n, _ in places), tuple(j for _, j in places), tuple(stages)))
    return ties


class TiedGradients:
    """Sums, among the stages holding its ends, the gradient of each tied parameter this stage
    holds. Built on every stage of a pipeline (the communicators are split collectively)."""

    def __init__(
        self,
        ties: Sequence[Tie],
        layers: Sequence[tuple[str, nn.Module]],
        owned: range,
        stage: int,
        world: Communicator,
        pipelines: Sequence[Sequence[int]],
    ) -> None:
        """``pipelines``: the world ranks of each data-parallel copy's stages, in stage order. A
        tie's ends are summed within each copy (the copies' own sums are then alike, and the
        stage's gradient all-reduce over copies keeps them so)."""
        self.ties = list(ties)
        self.stage = stage
        self._local: list[tuple[Tie, nn.Parameter, Communicator]] = []
        groups: dict[tuple[int, ...], Communicator] = {}
        for stages in sorted({t.stages for t in self.ties}):
            tied = [[copy[s] for s in stages] for copy in pipelines]
            inside = {r for g in tied for r in g}
            others = [[r] for r in range(world.world_size) if r not in inside]
            # every process of the job calls it (torch's new_group is collective over the world)
            groups[stages] = world.split([*tied, *others])
        for tie in self.ties:
            if stage not in tie.stages:
                continue
            name, j = next((n, j) for n, j in zip(tie.names, tie.layers) if j in owned)
            param = layers[j][1].get_parameter(name[len(layers[j][0]) + 1 :])
            self._local.append((tie, param, groups[tie.stages]))

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p, _ in self._local]

    def duplicates(self) -> list[nn.Parameter]:
        """This stage's ends of ties whose first end is on another stage: after ``sum_`` they hold
        the same gradient as that end, so a norm over the whole pipeline counts them there only."""
        return [p for tie, p, _ in self._local if self.stage != min(tie.stages)]

    def sum_(self) -> None:
        """After a step's backward: every end's gradient becomes the sum over the ends."""
        for _, p, comm in self._local:
            if not p.requires_grad:
                continue
            if p.grad is None:  # this end took no part in the step: it adds nothing
                p.grad = torch.zeros_like(p)
            # a stage sharded over its copies holds a shard of each end (a DTensor): copy c of
            # every stage holds the same rows (shard c of the same shape), so the shards are summed
            comm.all_reduce_(_local(p.grad), "sum")


def _local(t: torch.Tensor) -> torch.Tensor:
    """``t``, or this process's shard of a DTensor (its storage: reduced in place)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
