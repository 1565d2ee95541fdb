"""Sharded checkpoints: modules and optimizers saved with torch.distributed.checkpoint, each rank its part.

Under a strategy whose state is sharded (``extended.state_layout`` is ``StateLayout.SHARDED``:
ShardedStrategy, ModelParallelStrategy), a checkpoint's modules and optimizers are written by ``torch.distributed.checkpoint`` into
``ckpt-<step>/sharded/`` (every process writes its own shards, in parallel); per-replica objects
(RNG, data iterators) go to ``rank-<r>.*``, written by each rank, and the rest (a step) to
``shared.*``. The checkpoint is the manager's format otherwise: written into a temporary
directory, listed with sizes and sha256 in ``metadata.json`` (with a ``sharded`` entry), renamed
into place, verified before loading. Loading reshards: into another number of processes, or a
plain model in a single process with no process group. ``ShardedWriter`` is this path as the
manager's ``CheckpointWriter`` (writer.py); it reaches the manager only through a ``WriteSite``.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratagem.distribute.ownership import strategy_of
from stratagem.train.checkpoint.codec import encode_value
from stratagem.train.checkpoint.files import (
    FORMAT,
    _canonical,
    _fsync_dir,
    _payload,
    _sha256,
    _write,
    read_part,
)
from stratagem.train.checkpoint.lock import writer_tag
from stratagem.train.checkpoint.states import (
    _state_of,
    apply_states,
    portable_states,
    validate_states,
)
from stratagem.train.checkpoint.writer import WriteSite


def _split(objects: dict[str, Any]) -> tuple[dict[str, nn.Module], dict[str, tuple[torch.optim.Optimizer, str]], dict[str, Any]]:
    """Modules, optimizers (with the name of the module they step) and everything else."""
    modules = {n: o for n, o in objects.items() if isinstance(o, nn.Module)}
    optims: dict[str, tuple[torch.optim.Optimizer, str]] = {}
    for name, o in objects.items():
        if not isinstance(o, torch.optim.Optimizer):
            continue
        owner_strategy = strategy_of(o)
        if owner_strategy is not None:  # pointed at the shards that replaced its meta parameters
            owner_strategy.extended.prepare_optimizer(o)
        ids = {id(p) for g in o.param_groups for p in g["params"]}
        owner = next((mn for mn, m in modules.items() if any(id(p) in ids for p in m.parameters())), None)
        if owner is None:
            raise ValueError(
                f"Checkpoint({name}=optimizer): a sharded checkpoint saves an optimizer's state by "
                "its module's parameter names; put the module it steps in the same Checkpoint"
            )
        optims[name] = (o, owner)
    rest = {n: o for n, o in objects.items() if n not in modules and n not in optims}
    return modules, optims, rest


def _dcp_state(modules: dict[str, nn.Module], optims: dict[str, tuple[torch.optim.Optimizer, str]]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, Any] = {}
    for n, m in modules.items():
        own = get_model_state_dict(m)
        for alias in _tied(m):  # a tied weight is saved once, under its first name
            own.pop(alias, None)
        state[n] = own
    for n, (o, mn) in optims.items():
        state[n] = get_optimizer_state_dict(modules[mn], o)
    return state


def _tied(module: nn.Module) -> dict[str, str]:
    """Each later name of a parameter registered under several names (a tied weight: nanoGPT's
    ``lm_head.weight`` is ``transformer.wte.weight``) -> its first name."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        kept = first.setdefault(id(p), name)
        if kept != name:
            out[name] = kept
    return out


def _is_per_rank(obj: Any) -> bool:
    return not isinstance(obj, (torch.Tensor, int, float))


def _encode(name_objs: dict[str, Any]) -> tuple[bytes, bytes]:
    tensors: dict[str, torch.Tensor] = {}
    struct = {n: encode_value(_state_of(n, o), tensors, n) for n, o in name_objs.items()}
    return _payload(struct, tensors)


def _hash(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and sha256 of each file, read in 4 MB pieces (a shard is never read whole)."""
    import hashlib

    out = {}
    for name in names:
        h = hashlib.sha256()
        size = 0
        with open(root / name, "rb") as f:
            while piece := f.read(4 << 20):
                h.update(piece)
                size += len(piece)
        out[name] = {"size": size, "sha256": h.hexdigest()}
    return out


class ShardedWriter:
    """``CheckpointWriter`` through torch.distributed.checkpoint: every rank writes its shards."""

    def save(self, site: WriteSite, step: int) -> str:
        return save(site, step)

    def prepare(self, site: WriteSite, path: Path, meta: dict[str, Any]) -> Callable[[], None]:
        return prepare(site, path, meta)


def save(site: WriteSite, step: int) -> str:
    """Every process writes its part of ``site.objects`` at ``step``; returns the path.

    The chief holds the directory's writer lock and names the temporary directory after itself
    (as the manager's own saves do), so a dead writer's leftovers are cleaned and a failed save
    removes its own files."""
    comm = site.comm
    rank = comm.rank
    modules, optims, rest = _split(site.objects)
    directory = site.directory
    _check_one_directory(comm, directory)
    problem = ("", "")
    tmp_name = ""
    if rank == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            site.own_directory()
            tmp_name = f".tmp-ckpt-{step}+{writer_tag()}+{uuid.uuid4().hex[:8]}"
            (directory / tmp_name).mkdir()
        except Exception as e:  # noqa: BLE001 - raised on every replica by _agree
            problem = (type(e).__name__, str(e))
    site.agree(problem)
    tmp = directory / comm.broadcast_object(tmp_name, 0)
    try:
        return _write_parts(site, step, tmp, modules, optims, rest)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_parts(
    site: WriteSite,
    step: int,
    tmp: Path,
    modules: dict[str, nn.Module],
    optims: dict[str, tuple[torch.optim.Optimizer, str]],
    rest: dict[str, Any],
) -> str:
    import torch.distributed.checkpoint as dcp

    comm = site.comm
    rank, world = comm.rank, comm.world_size
    directory = site.directory
    # torch initialises an optimizer that has not stepped by stepping it with zero gradients;
    # put it back (and say so in the metadata), so saving does not change its next update
    fresh = sorted(n for n, (o, _) in optims.items() if not o.state)
    dcp.save(_dcp_state(modules, optims), checkpoint_id=str(tmp / "sharded"))  # errors reach every rank
    for n in fresh:
        optims[n][0].state.clear()
    problem = ""
    try:
        struct, tensors = _encode({n: o for n, o in rest.items() if _is_per_rank(o)})
        _write(tmp / f"rank-{rank}.json", struct)
        _write(tmp / f"rank-{rank}.safetensors", tensors)
        if rank == 0:
            struct, tensors = _encode({n: o for n, o in rest.items() if not _is_per_rank(o)})
            _write(tmp / "shared.json", struct)
            _write(tmp / "shared.safetensors", tensors)
    except Exception as e:  # noqa: BLE001 - agreed on below
        problem = f"replica {rank}: {type(e).__name__}: {e}"
    problems = [p for p in comm.all_gather_object(problem) if p]
    if problems:
        raise RuntimeError(f"the sharded checkpoint at step {step} could not be written ({'; '.join(problems)})")
    names = _listing_all_see(comm, tmp, directory)
    # every file hashed once, the work split across ranks
    files = comm.all_gather_object(_hash(tmp, names[rank::world]))
    result = ("", "")
    if rank == 0:
        try:
            listing = {k: v for part in files for k, v in part.items()}
            body = {
                "format": FORMAT,
                "step": step,
                "world_size": world,
                "files": listing,
                "sharded": {
                    "modules": sorted(modules),
                    "optimizers": {n: mn for n, (_, mn) in optims.items()},
                    "fresh_optimizers": fresh,
                },
            }
            _write(tmp / "metadata.json", json.dumps({**body, "sha256": _sha256(_canonical(body))}, indent=1).encode())
            _fsync_dir(tmp)
            _fsync_dir(tmp / "sharded")
            final = directory / f"ckpt-{step}"
            old = None
            if final.exists():  # re-saving a step: the old one set aside until replaced
                old = directory / f".old-ckpt-{step}+{writer_tag()}+{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
            os.rename(tmp, final)
            _fsync_dir(directory)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            site.prune()
            result = (str(final), "")
        except Exception as e:  # noqa: BLE001 - sent to every replica below
            result = ("", f"{type(e).__name__}: {e}")
    result = comm.broadcast_object(result, 0)
    if result[1]:
        raise RuntimeError(f"the chief could not commit the sharded checkpoint at step {step}: {result[1]}")
    return result[0]


def _check_one_directory(comm: Any, directory: Path) -> None:
    """A clear error on every rank, before anything is written, unless all name one directory."""
    dirs = comm.all_gather_object(str(directory.resolve()))
    if len(set(dirs)) > 1:
        listing = "; ".join(f"replica {r}: {d}" for r, d in enumerate(dirs))
        raise ValueError(
            "a sharded checkpoint is one directory that every process writes its shards into, "
            f"but the processes passed different directories ({listing}): pass every worker the "
            "same directory, on storage all of them reach (TensorFlow's per-worker write_filepath "
            "is for a MirroredStrategy checkpoint, which the chief writes alone)"
        )


def _listing_all_see(comm: Any, tmp: Path, directory: Path) -> list[str]:
    """The files of the save in ``tmp``, as the chief sees them; a clear error on every rank when
    the chief does not see what another rank wrote (the directory is not on shared storage)."""
    mine = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    listings = comm.all_gather_object(mine)
    unseen = {r: sorted(set(names) - set(listings[0])) for r, names in enumerate(listings)}
    unseen = {r: names for r, names in unseen.items() if names}
    if unseen:
        if comm.rank in unseen:  # this rank's own files, where only it sees them
            shutil.rmtree(tmp, ignore_errors=True)
        listing = "; ".join(f"replica {r}: {', '.join(names[:3])}" for r, names in unseen.items())
        raise RuntimeError(
            f"the sharded checkpoint directory {directory} is not shared: the chief does not see "
            f"the files other processes wrote there ({listing}); put it on storage every worker "
            "reaches (a shared filesystem). Nothing of this save was kept"
        )
    return listings[0]  # type: ignore[no-any-return]


def _fqn_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, native: dict[str, Any]) -> dict[str, Any]:
    """torch's optimizer state (parameters by index) keyed by the parameters' names instead."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    state = {order[int(i)]: st for i, st in native["state"].items()}
    groups = [{**g, "params": [order[int(i)] for i in g["params"]]} for g in native["param_groups"]]
    return {"state": state, "param_groups": groups}


def prepare(site: WriteSite, path: Path, meta: dict[str, Any]) -> Callable[[], None]:
    """Check ``path`` against ``site.objects`` and read what is not sharded (each replica,
    before the replicas agree to go on); returns the load, which is collective."""
    modules, optims, rest = _split(site.objects)
    shared = read_part(path, "shared", meta)
    if "sharded" in meta:
        saved = meta["sharded"]
        want = sorted(modules), {n: mn for n, (_, mn) in optims.items()}
        if (saved["modules"], saved["optimizers"]) != want:
            raise KeyError(
                f"the checkpoint holds modules {saved['modules']} and optimizers {saved['optimizers']}; "
                f"this Checkpoint has modules {want[0]} and optimizers {want[1]}: restore with the same objects"
            )
    else:
        missing = [n for n in (*modules, *optims) if n not in shared]
        if missing:  # saved per process (a pipeline's stages): joined, an optimizer by parameter name
            objects = {**modules, **{n: o for n, (o, _) in optims.items()}}
            comm = site.comm
            joined = portable_states(path, meta, objects, comm.rank, comm.world_size)
            shared = {**shared, **{n: joined[n] for n in missing if n in joined}}
        missing = [n for n in (*modules, *optims) if n not in shared]
        if missing:
            raise KeyError(f"the checkpoint has no state for {missing} (it has {sorted(shared)})")
    rest_states = _rest_states(site, path, meta, rest, shared)
    if rest:
        validate_states(rest, rest_states)

    def load() -> None:
        if "sharded" in meta:
            _load_sharded(path, meta, modules, optims)
        else:
            _load_whole(shared, modules, optims)
        _apply_rest(site, rest, rest_states)

    return load


def _load_whole(states: dict[str, Any], modules: dict[str, nn.Module], optims: dict[str, tuple[torch.optim.Optimizer, str]]) -> None:
    """Whole tensors (a mirrored checkpoint) into sharded modules and optimizers."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    for n, m in modules.items():
        set_model_state_dict(m, states[n], options=full)
    for n, (o, mn) in optims.items():
        set_optimizer_state_dict(modules[mn], o, _fqn_optimizer_state(modules[mn], o, states[n]), options=full)


def _load_sharded(path: Path, meta: dict[str, Any], modules: dict[str, nn.Module], optims: dict[str, tuple[torch.optim.Optimizer, str]]) -> None:
    """A sharded checkpoint into any modules and optimizers (resharded by DCP)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _dcp_state(modules, optims)
    alone = not (dist.is_available() and dist.is_initialized())  # a plain process: no group
    with warnings.catch_warnings():
        if alone:  # torch says it assumes a single process: that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path / "sharded"), no_dist=alone)
    for n, m in modules.items():
        for alias, kept in _tied(m).items():  # the tie's other names read the one saved tensor
            if kept in state[n]:
                state[n][alias] = state[n][kept]
        set_model_state_dict(m, state[n])
    for n, (o, mn) in optims.items():
        set_optimizer_state_dict(modules[mn], o, state[n])
        if n in meta["sharded"].get("fresh_optimizers", ()):
            o.state.clear()  # saved before its first step: it has none


def _rest_states(site: WriteSite, path: Path, meta: dict[str, Any], rest: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """The states of the objects besides modules and optimizers (steps; RNG, iterators per rank)."""
    states = {n: v for n, v in shared.items() if n in rest}
    per_rank = [n for n, o in rest.items() if _is_per_rank(o)]
    if per_rank:
        rank, world = site.comm.rank, site.comm.world_size
        if meta["world_size"] != world:
            raise ValueError(
                f"checkpoint {path} was written by {meta['world_size']} replicas; this job has {world}. "
                f"Its sharded modules and optimizers load into any number, but per-replica objects "
                f"{per_rank} cannot be mapped: leave them out of the Checkpoint, or restore with "
                f"{meta['world_size']} replicas"
            )
        states.update({n: v for n, v in read_part(path, f"rank-{rank}", meta).items() if n in rest})
    return states


def _apply_rest(site: WriteSite, rest: dict[str, Any], states: dict[str, Any]) -> None:
    if not rest:
        return
    sub = dict(rest)
    apply_states(sub, states)
    for n, o in sub.items():
        site.replace(n, o)
