"""Weights tied across pipeline stages in a checkpoint: written once, by the lowest stage holding
an end (one tensor under every name of the tie: the codec stores it once), and read back into
the end every stage holds; a checkpoint that lacks the tied weight, or holds different values
under its names, is refused naming the tie."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from stratagem.distribute.strategy import Execution
from stratagem.pipeline.ties import Tie


def _keys(tie: Tie, keys: Sequence[str]) -> list[str] | None:
    """The state-dict keys of the tie's names in a module (the model given to
    ``strategy.pipeline``, or one holding it under a prefix); None if some name has none."""
    out = []
    for name in tie.names:
        found = [k for k in keys if k == name or k.endswith("." + name)]
        if len(found) != 1:
            return None
        out.append(found[0])
    return out


class StageTies:
    """The ties of the pipeline whose stage ``stage`` this process runs."""

    def __init__(self, ties: Sequence[Tie], stage: int) -> None:
        self.ties = list(ties)
        self.stage = stage

    @staticmethod
    def of(extended: Any) -> StageTies | None:
        """The ties of a pipeline strategy's last ``pipeline()``; None for other strategies."""
        ties = getattr(extended, "ties", None)
        if not ties or getattr(extended, "execution", None) is not Execution.PIPELINE:
            return None
        return StageTies(ties, int(extended.stage))

    def saved(self, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (this stage's entries of ``module``) with each tie written once: on the lowest
        stage holding it, its end's tensor under every name of the tie; on the others, nothing."""
        out = dict(state)
        keys = list(module.state_dict(keep_vars=True))
        for tie in self.ties:
            found = _keys(tie, keys)
            if found is None or self.stage not in tie.stages:
                continue
            if self.stage != min(tie.stages):
                for k in found:
                    out.pop(k, None)
                continue
            mine = [k for k in found if k in state]
            if mine:
                for k in found:
                    out[k] = state[mine[0]]
        return out

    def restored(self, name: str, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a module's, joined from every stage of the checkpoint) with every name of
        each tie holding the tied tensor, so each stage's end is restored from it."""
        out = dict(state)
        keys = list(module.state_dict(keep_vars=True))
        for tie in self.ties:
            found = _keys(tie, keys)
            if found is None:
                continue
            present = [k for k in found if k in state]
            if not present:
                raise KeyError(
                    f"the checkpoint's {name!r} lacks the weight tied across stages {tie}, which the "
                    f"lowest stage holding it (stage {min(tie.stages)}) writes under every name "
                    f"({', '.join(found)}); restore from a checkpoint of the same pipelined model"
                )
            first = state[present[0]]
            for k in present[1:]:
                other = state[k]
                same = (
                    isinstance(first, torch.Tensor) and isinstance(other, torch.Tensor)
                    and first.shape == other.shape and torch.equal(first, other)
                )  # fmt: skip
                if not same:
                    raise ValueError(
                        f"the checkpoint's {name!r} holds different values for {present[0]} and {k}, "
                        f"which are one weight tied across stages ({tie}); the checkpoint was not "
                        "written by this model's pipeline (or was altered): restore from one that was"
                    )
            for k in found:
                out[k] = first
        return out
