"""Whole-file checkpoints of sharded parameters: a DTensor is written as its whole tensor and
restored into the live DTensor's shard, so a checkpoint of a model sharded one way (a pipeline's
stages sharded over their copies) restores under any strategy, and back."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stratagem.core.whole import whole_tensor


def _dtensor_type() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


def whole(state: Any) -> Any:
    """``state`` with every DTensor replaced by its whole tensor (a collective over its mesh:
    every process holding a shard calls it, in the same order)."""
    dtensor = _dtensor_type()
    if isinstance(state, dtensor):
        return whole_tensor(state)
    if isinstance(state, dict):
        return {k: whole(v) for k, v in state.items()}
    if isinstance(state, list):
        return [whole(v) for v in state]
    if isinstance(state, tuple):
        return tuple(whole(v) for v in state)
    return state


def _like(value: Any, live: Any) -> Any:
    """``value`` (a whole tensor) as ``live``'s shard when ``live`` is a DTensor of its shape."""
    dtensor = _dtensor_type()
    if isinstance(live, dtensor) and isinstance(value, torch.Tensor) and not isinstance(value, dtensor):
        if tuple(value.shape) == tuple(live.shape):
            from torch.distributed.tensor import distribute_tensor

            # every process has the whole tensor: each keeps its own part, nothing is sent
            return distribute_tensor(
                value.to(device=live.device), live.device_mesh, live.placements, src_data_rank=None
            )
    return value


def for_module(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A module's ``state`` (whole tensors) as its ``load_state_dict`` takes it: the entries of
    sharded parameters as DTensors placed as the live ones."""
    live = module.state_dict()
    return {k: _like(v, live.get(k)) for k, v in state.items()}


def for_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state`` (whole tensors) as its ``load_state_dict`` takes it: a sharded
    parameter's moments (tensors of the parameter's shape) as DTensors placed as the parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = state.get("state")
    if not isinstance(per_param, dict):
        return state
    out: dict[Any, Any] = {}
    for index, entry in per_param.items():
        p = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
        if p is None or not isinstance(entry, dict):
            out[index] = entry
            continue
        out[index] = {k: _like(v, p) for k, v in entry.items()}
    return {**state, "state": out}
