"""What a checkpoint knows about the objects it saves, below the manager and its writers.

An object's state (``_state_of``), ``RNGState``, the states of a dict of objects encoded for the
file (``encode_states``), checked against the objects (``validate_states``: keys, shapes, dtypes,
structure) and assigned to them (``apply_states``), and ``portable_states``: any whole-file
checkpoint's states for one replica of any job. ``Checkpoint`` (manager.py) and both writers
(portable.py, sharded.py) use these; this module imports neither.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stratagem.core.warn import warn_user
from stratagem.distribute import determinism
from stratagem.train.checkpoint import dtensors, optim_names
from stratagem.train.checkpoint.codec import encode_value
from stratagem.train.checkpoint.files import read_part
from stratagem.train.checkpoint.ties import StageTies


class RNGState:
    """The random state of this process: python ``random``, numpy, torch CPU and CUDA generators,
    and (in the deterministic mode) how many steps ``strategy.run`` cut into pieces, which its
    pieces' random numbers follow."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        if determinism.piece_runs():  # the deterministic mode's custom-loop steps so far
            state["pieces"] = determinism.piece_runs()
        return state

    @staticmethod
    def validate(state: Any) -> None:
        """Raise ValueError unless ``state`` is an RNG state this process can load."""
        try:
            version, internal, _ = state["python"]
            ok = isinstance(version, int) and len(internal) == 625 and all(isinstance(i, int) for i in internal)
            ok = ok and len(state["numpy"]) == 5 and len(np.asarray(state["numpy"][1])) == 624
            t = state["torch"]
            ok = ok and isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape == torch.get_rng_state().shape
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError("the checkpoint's RNG state is not one of python random, numpy and torch")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(tuple(state["numpy"]))  # type: ignore[arg-type]
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        determinism.restore_piece_runs(int(state.get("pieces", 0)))


def _is_shared(obj: Any) -> bool:
    return isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.Tensor, int, float))


def _state_of(name: str, obj: Any) -> Any:
    if isinstance(obj, (torch.Tensor, int, float)) and not isinstance(obj, bool):
        return obj
    if isinstance(obj, nn.Module):
        # a pipeline stage's model keeps the other stages' parameters on the meta device
        return {k: v for k, v in obj.state_dict().items() if not (isinstance(v, torch.Tensor) and v.is_meta)}
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
        return obj.state_dict()
    raise TypeError(
        f"Checkpoint({name}=...): a {type(obj).__name__} has no state_dict/load_state_dict; pass "
        "modules, optimizers, data iterators, RNGState(), ints or tensors"
    )


def check_objects(objects: Mapping[str, Any]) -> None:
    """Raise TypeError naming the first object that cannot be saved (no state_dict/load_state_dict)."""
    for name, obj in objects.items():
        _state_of(name, obj)


def encode_states(
    objects: dict[str, Any], shared: bool | None, ties: StageTies | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The shared (or per-replica, or with None all) objects' states as a JSON structure
    and flat tensors; ``ties``: a pipeline stage's weights tied to other stages' (written
    once, by the lowest stage holding each)."""
    tensors: dict[str, torch.Tensor] = {}
    struct = {}
    names = optim_names.parameter_names(objects.values())
    for name, obj in objects.items():
        if shared is None or _is_shared(obj) == shared:
            state = _state_of(name, obj)
            if isinstance(obj, (nn.Module, torch.optim.Optimizer)):
                state = dtensors.whole(state)  # sharded parameters and moments, whole
            if isinstance(obj, torch.optim.Optimizer):  # its parameters' names: it moves between meshes
                state = optim_names.with_names(state, obj, names)
            if ties is not None and isinstance(obj, nn.Module):
                state = ties.saved(obj, state)
            struct[name] = encode_value(state, tensors, name)
    return struct, tensors


def apply_states(objects: dict[str, Any], states: dict[str, Any]) -> None:
    """Load decoded ``states`` (every object's) into the objects: everything is validated
    first (keys, shapes, dtypes, structure), so a failed restore leaves the objects as they
    were (a per-replica object whose own ``load_state_dict`` fails is put back too). An int or
    float object is replaced in ``objects`` by its restored value."""
    validate_states(objects, states)
    done: list[tuple[Any, Any]] = []
    # objects the validation cannot see into first (rolled back on failure), then the RNG,
    # optimizers and modules (validated fully above)
    order = sorted(objects.items(), key=lambda kv: _apply_rank(kv[1]))
    try:
        for name, obj in order:
            state = states[name]
            if isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    obj.copy_(state)
            elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
                objects[name] = type(obj)(state)
            elif isinstance(obj, nn.Module):
                obj.load_state_dict(dtensors.for_module(obj, _module_subset(obj, state)), strict=False)
            else:
                before = obj.state_dict() if _apply_rank(obj) == 0 else None
                if isinstance(obj, torch.optim.Optimizer):
                    state = dtensors.for_optimizer(obj, optim_names.without_names(state))
                obj.load_state_dict(state)
                if before is not None:
                    done.append((obj, before))
    except Exception:
        for obj, before in reversed(done):
            try:
                obj.load_state_dict(before)
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        raise


def validate_states(objects: dict[str, Any], states: dict[str, Any]) -> None:
    """Raise (naming the object and the key) unless ``states`` fits every object."""
    missing = [n for n in objects if n not in states]
    if missing:
        raise KeyError(
            f"the checkpoint has no state for {missing} (it has {sorted(states)}); restore "
            "with a Checkpoint of the same objects"
        )
    for name, obj in objects.items():
        state = states[name]
        if isinstance(obj, torch.Tensor):
            if not isinstance(state, torch.Tensor) or state.shape != obj.shape:
                raise ValueError(
                    f"the checkpoint's {name!r} is {_describe(state)}, the live tensor has "
                    f"shape {tuple(obj.shape)}; restore into a tensor of the same shape"
                )
        elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
            if isinstance(state, bool) or not isinstance(state, (int, float, torch.Tensor)):
                raise ValueError(f"the checkpoint's {name!r} is {_describe(state)}, not a number")
        elif isinstance(obj, nn.Module):
            _validate_module(name, obj, state)
        elif isinstance(obj, torch.optim.Optimizer):
            _validate_optimizer(name, obj, state)
        elif isinstance(obj, RNGState):
            RNGState.validate(state)


def _apply_rank(obj: Any) -> int:
    if isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.Tensor, int, float, RNGState)):
        return 1
    return 0


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _module_subset(module: nn.Module, state: Any) -> dict[str, Any]:
    """The entries of ``state`` this module holds (a pipeline stage holds only its layers)."""
    want = _state_of("", module)
    return {k: state[k] for k in want}


def _validate_module(name: str, module: nn.Module, state: Any) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"the checkpoint's {name!r} is {_describe(state)}, not a module's state dict")
    want = _state_of(name, module)
    full = {k for k, v in module.state_dict().items()}
    staged = len(want) < len(full)  # a pipeline stage: the other stages' layers are on meta
    lacks = sorted(set(want) - set(state))
    extra = [] if staged else sorted(set(state) - set(want))
    if lacks or extra:
        raise KeyError(
            f"the checkpoint's {name!r} has tensors {extra[:4]} this model lacks and lacks "
            f"{lacks[:4]}; restore into the same model (under a pipeline: the same layers)"
        )
    for key, live in want.items():
        saved = state[key]
        if not isinstance(live, torch.Tensor):
            continue
        if not isinstance(saved, torch.Tensor):
            raise ValueError(f"the checkpoint's {name}.{key} is {_describe(saved)}, the model's is a tensor")
        if saved.shape != live.shape or saved.dtype != live.dtype:
            raise ValueError(
                f"the checkpoint's {name}.{key} is {_describe(saved)}, the model's is "
                f"{_describe(live)}; restore into the same model (same sizes and dtypes)"
            )


#: optimizer state entries that have their parameter's shape (torch's optimizers)
_PER_PARAMETER = {
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
    "sum", "ax", "prev", "grad_avg", "exp_inf",
}  # fmt: skip


def _validate_optimizer(name: str, opt: torch.optim.Optimizer, state: Any) -> None:
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list) or not isinstance(state.get("state"), dict):
        raise ValueError(f"the checkpoint's {name!r} is not an optimizer's state dict")
    groups, saved = opt.param_groups, state["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    saved_sizes = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in saved]
    if sizes != saved_sizes:
        raise ValueError(
            f"the checkpoint's {name!r} has parameter groups of sizes {saved_sizes}, this optimizer "
            f"{sizes}; restore into an optimizer over the same parameters"
        )
    params = {pid: p for g, sg in zip(groups, saved) for p, pid in zip(g["params"], sg["params"])}
    for pid, pstate in state["state"].items():
        if pid not in params or not isinstance(pstate, dict):
            raise ValueError(f"the checkpoint's {name!r} has state for parameter {pid!r}, which no group lists")
        shape = params[pid].shape
        for key, value in pstate.items():
            if key in _PER_PARAMETER and isinstance(value, torch.Tensor) and value.shape != shape:
                raise ValueError(
                    f"the checkpoint's {name!r} holds {key} of shape {tuple(value.shape)} for a "
                    f"parameter of shape {tuple(shape)}; restore into an optimizer over the same parameters"
                )


# --- portability: any checkpoint into any job ------------------------------------------------------
def portable_states(
    path: Path, meta: dict[str, Any], objects: Mapping[str, Any], rank: int, world: int
) -> dict[str, Any]:
    """The state of each of ``objects`` (a Checkpoint's, by name) for replica ``rank`` of
    ``world``, from a checkpoint written by ``meta["world_size"]`` processes under any strategy.

    - Modules, optimizers, tensors and numbers saved once (data-parallel: mirrored) load as saved.
    - A module saved per process (pipeline stages) is joined from every stage; each module then
      takes the layers it holds (an unsplit model all of them, a stage its own), so pipeline ->
      unsplit, unsplit -> pipeline and other stage boundaries all work. An optimizer's state,
      saved with its parameters' names, loads into an optimizer over other parameters (a
      stage's, the whole model's) by name: the stages' parts are joined (``optim_names``).
    - With the same number of replicas, per-replica objects (RNG, data iterators) load exactly.
      With another number: ``RNGState`` of replica ``r`` loads the saved replica ``r``'s streams
      (replicas beyond the saved ones keep theirs, with a warning); an object whose class has
      ``reshard_state(states, rank, world)`` (a ``DistributedIterator``: every replica reads the
      same global batches, so the position carries over exactly) gets what it returns; any other
      per-replica object is an error naming it (leave it out of the Checkpoint to restore the
      rest).
    """
    saved_world = int(meta["world_size"])
    shared = read_part(path, "shared", meta)
    parts: dict[int, dict[str, Any]] = {}

    def part(r: int) -> dict[str, Any]:
        if r not in parts:
            parts[r] = read_part(path, f"rank-{r}", meta)
        return parts[r]

    same = saved_world == world
    states: dict[str, Any] = {}
    skipped_rng: list[str] = []
    names = optim_names.parameter_names(objects.values())
    what = f"checkpoint {path}"

    def elsewhere(obj: Any, state: Any) -> bool:
        """An optimizer's state saved over other parameters (another split): matched by name."""
        return isinstance(obj, torch.optim.Optimizer) and optim_names.needs_rekey(state, obj, names)

    for name, obj in objects.items():
        if name in shared:
            saved = shared[name]
            states[name] = optim_names.rekey([saved], obj, names, what) if elsewhere(obj, saved) else saved
            continue
        if same and name in part(rank) and not isinstance(obj, nn.Module) and not elsewhere(obj, part(rank)[name]):
            states[name] = part(rank)[name]
            continue
        present = [r for r in range(saved_world) if name in part(r)]
        if not present:
            continue  # reported by validate: no state for it
        if isinstance(obj, torch.optim.Optimizer) and all(optim_names.NAMES in part(r)[name] for r in present):
            # an optimizer saved per stage: the stages' parts joined by parameter name
            states[name] = optim_names.rekey([part(r)[name] for r in present], obj, names, f"{what}: {name!r}")
            continue
        if isinstance(obj, nn.Module):
            joined: dict[str, Any] = {}
            for r in present:
                for k, v in part(r)[name].items():
                    joined.setdefault(k, v)
            states[name] = joined
        elif isinstance(obj, RNGState):
            if rank < saved_world:
                states[name] = part(rank)[name]
            else:
                skipped_rng.append(name)
        elif hasattr(type(obj), "reshard_state"):
            states[name] = type(obj).reshard_state([part(r)[name] for r in present], rank, world)
        else:
            what = "an optimizer of a pipeline stage" if isinstance(obj, torch.optim.Optimizer) else f"a {type(obj).__name__}"
            raise ValueError(
                f"checkpoint {path} was written by {saved_world} processes; this job has {world}. "
                f"{name!r} ({what}) is per-process state that cannot be mapped to another number "
                f"of processes: restore with {saved_world}, or leave {name!r} out of the Checkpoint "
                "(modules and mirrored optimizers restore into any number)"
            )
    for name in skipped_rng:  # this replica keeps its own streams (loading them is a no-op)
        states[name] = objects[name].state_dict()
    rngs = sorted(n for n, o in objects.items() if isinstance(o, RNGState))
    if world > saved_world and rngs:  # said once, for the job, by rank 0
        warn_user(
            f"checkpoint {path} has the RNG streams of {saved_world} replicas; replicas "
            f"{saved_world}..{world - 1} of {world} keep their own {', '.join(map(repr, rngs))}",
            stacklevel=3,
        )
    return states
