"""An optimizer's state keyed by its parameters' names, so it moves between meshes.

``optimizer.state_dict()`` keys each parameter by its index in the optimizer's groups: the state
of a pipeline stage's optimizer (over that stage's parameters) means nothing to an optimizer over
the whole model, or over another split. A checkpoint therefore also writes, beside the state,
the name of every parameter in its groups (the name the checkpoint's modules give it: a model's
``named_parameters``, a pipeline's original names), and a restore that finds other names than
the live optimizer's joins the saved parts by name and keys them by the live optimizer's
indices. DCP's ``get_optimizer_state_dict`` keys by the same names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

#: the key, beside ``state`` and ``param_groups``, under which a checkpoint lists the names
NAMES = "stratagem_param_names"


def parameter_names(objects: Iterable[Any]) -> dict[int, str]:
    """id(parameter) -> its name, from every module (or pipeline) among ``objects``."""
    names: dict[int, str] = {}
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer) or not hasattr(obj, "named_parameters"):
            continue  # modules, and pipelines (their stage's parameters under the model's names)
        for n, p in obj.named_parameters():
            names.setdefault(id(p), n)
    return names


def group_names(opt: torch.optim.Optimizer, names: Mapping[int, str]) -> list[list[str]] | None:
    """The names of ``opt``'s parameters, group by group; None when one has no name."""
    out = [[names.get(id(p), "") for p in g["params"]] for g in opt.param_groups]
    return None if any(not n for g in out for n in g) else out


def with_names(state: dict[str, Any], opt: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """``state`` (``opt``'s state dict) with its parameters' names beside it, when all have one."""
    groups = group_names(opt, names)
    return state if groups is None else {**state, NAMES: groups}


def without_names(state: Any) -> Any:
    return {k: v for k, v in state.items() if k != NAMES} if isinstance(state, dict) else state


def needs_rekey(saved: Any, opt: torch.optim.Optimizer, names: Mapping[int, str]) -> bool:
    """Whether a saved state names other parameters than ``opt``'s (and both are named)."""
    if not isinstance(saved, dict) or NAMES not in saved:
        return False
    live = group_names(opt, names)
    return live is not None and live != saved[NAMES]


def rekey(parts: list[Any], opt: torch.optim.Optimizer, names: Mapping[int, str], what: str) -> dict[str, Any]:
    """The state dict for ``opt`` from ``parts`` (optimizer states saved with names: one per
    pipeline stage, or one whole), matched by parameter name. Each group takes the saved group's
    hyperparameters of the same position; a parameter the checkpoint does not name is an error."""
    live = group_names(opt, names)
    if live is None:
        raise ValueError(
            f"{what}: this optimizer has parameters no module of the Checkpoint names, so the saved "
            "state (written under another split of the model) cannot be matched to them: put the "
            "model in the Checkpoint beside its optimizer"
        )
    by_name: dict[str, Any] = {}
    known: set[str] = set()
    hyper: dict[int, dict[str, Any]] = {}
    for part in parts:
        saved_names = part.get(NAMES) if isinstance(part, dict) else None
        if saved_names is None:
            raise ValueError(
                f"{what}: the checkpoint's optimizer state has no parameter names (written before "
                "they were saved), so it restores only into the same split of the model"
            )
        for g, (group, gnames) in enumerate(zip(part["param_groups"], saved_names)):
            hyper.setdefault(g, {k: v for k, v in group.items() if k != "params"})
            for pid, n in zip(group["params"], gnames):
                known.add(n)
                if pid in part["state"]:
                    by_name.setdefault(n, part["state"][pid])
    if len(hyper) != len(live):
        raise ValueError(
            f"{what}: the checkpoint's optimizer has {len(hyper)} parameter group(s), this one "
            f"{len(live)}; restore into an optimizer with the same groups"
        )
    missing = [n for g in live for n in g if n not in known]
    if missing:
        raise ValueError(
            f"{what}: the checkpoint holds no optimizer state for {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; restore into an optimizer over the same model"
        )
    state: dict[int, Any] = {}
    groups = []
    i = 0
    for g, gnames in enumerate(live):
        ids = []
        for n in gnames:
            if n in by_name:
                state[i] = by_name[n]
            ids.append(i)
            i += 1
        groups.append({**hyper[g], "params": ids})
    return {"state": state, "param_groups": groups}
