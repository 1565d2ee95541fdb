"""Checkpoint and CheckpointManager: collective, atomic, safetensors + JSON with a sha256 per file, never pickle.

``Checkpoint(**objects)`` names what to save: modules, optimizers, data iterators (anything with
``state_dict``/``load_state_dict`` whose state is tensors, numbers, strings, lists and dicts),
``RNGState()``, a step (an int or a tensor). ``CheckpointManager(checkpoint, directory,
max_to_keep)`` saves and restores it under a strategy: every replica calls ``save``/``restore``;
per-replica state (RNG streams, data iterators) is gathered to the chief, which alone writes.

Layout of ``directory/ckpt-<step>/``: ``shared.safetensors`` + ``shared.json`` (the chief's
modules, optimizers, step: mirrored, so identical on every replica), ``rank-<r>.safetensors`` +
``rank-<r>.json`` (per-replica objects), and ``metadata.json`` written last, listing every file
with its size and sha256 and carrying a sha256 of itself. Files are written into a temporary
directory, fsynced, and the directory renamed into place: a checkpoint exists only when all its
files do. Loading reads JSON and safetensors only, so a file carrying a pickle is refused, never
executed. Which objects are per replica: ``RNGState`` and anything that is not a module, an
optimizer, a tensor or a number (data iterators: each replica may read its own shard).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stratagem.distribute import current, ownership
from stratagem.distribute.strategy import Strategy
from stratagem.train.checkpoint.codec import CheckpointCorruptError, encode_value
from stratagem.train.checkpoint.files import (
    _payload,
    read_metadata,
    read_part,
    verify,
    write_checkpoint,
)

_CKPT = re.compile(r"^ckpt-(\d+)$")


class RNGState:
    """The random state of this process: python ``random``, numpy, torch CPU and CUDA generators."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(tuple(state["numpy"]))  # type: ignore[arg-type]
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


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


class Checkpoint:
    """The objects a checkpoint saves and restores, by name: ``Checkpoint(model=m, optimizer=o,
    data=iterator, rng=RNGState(), step=torch.tensor(0))``. Restored in place (an int ``step``
    is replaced: read it back as ``checkpoint.step``)."""

    def __init__(self, **objects: Any) -> None:
        if not objects:
            raise ValueError("Checkpoint() needs at least one object, e.g. Checkpoint(model=model)")
        for name, obj in objects.items():
            _state_of(name, obj)  # fail early on what cannot be saved
        self._objects = dict(objects)

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint has no object {name!r} (it has {sorted(objects)})")

    @property
    def objects(self) -> dict[str, Any]:
        return dict(self._objects)

    def encode(self, shared: bool | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The shared (or per-replica, or with None all) objects' states as a JSON structure
        and flat tensors."""
        tensors: dict[str, torch.Tensor] = {}
        struct = {
            name: encode_value(_state_of(name, obj), tensors, name)
            for name, obj in self._objects.items()
            if shared is None or _is_shared(obj) == shared
        }
        return struct, tensors

    def apply(self, states: dict[str, Any]) -> None:
        """Load decoded ``states`` (every object's) into the objects."""
        missing = [n for n in self._objects if n not in states]
        if missing:
            raise KeyError(
                f"the checkpoint has no state for {missing} (it has {sorted(states)}); restore "
                "with a Checkpoint of the same objects"
            )
        for name, obj in self._objects.items():
            state = states[name]
            if isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    obj.copy_(state)
            elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
                self._objects[name] = type(obj)(state)
            elif isinstance(obj, nn.Module):
                want = set(_state_of(name, obj))
                if set(state) != want:
                    raise KeyError(
                        f"the checkpoint's {name!r} has tensors {sorted(set(state) - want)[:4]} "
                        f"this model lacks and lacks {sorted(want - set(state))[:4]}; restore "
                        "into the same model (under a pipeline: the same stage)"
                    )
                obj.load_state_dict(state, strict=False)
            else:
                obj.load_state_dict(state)


# --- the manager ----------------------------------------------------------------------------------
class CheckpointManager:
    """Saves ``checkpoint`` as ``directory/ckpt-<step>``, keeping the newest ``max_to_keep``.

    Every replica calls ``save``/``restore``/``restore_or_initialize`` (they are collective); the
    chief writes. ``strategy`` defaults to the strategy that created the checkpoint's modules and
    optimizers, else the strategy whose scope is open at construction, else (when no process
    group exists) the default strategy; a different ``strategy=`` than the one that created them
    is an error. Restoring needs the directory on storage every worker can read.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 5,
        *,
        strategy: Strategy | None = None,
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        models = {
            name: obj
            for name, obj in checkpoint.objects.items()
            if isinstance(obj, (nn.Module, torch.optim.Optimizer))
        }
        open_scope = current.get_strategy() if current.has_strategy() else None
        chosen = ownership.resolve(models, strategy, open_scope, "CheckpointManager")
        if chosen is None:
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_world_size() > 1:
                raise ValueError(
                    "CheckpointManager: this process is one of a job of "
                    f"{dist.get_world_size()}; pass strategy=... or create the manager "
                    "inside strategy.scope()"
                )
            chosen = current.get_strategy()
        self.checkpoint = checkpoint
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self.strategy = chosen
        self._comm = chosen.extended.world
        self._all_per_rank = chosen.extended.state_is_per_rank
        self._on_file_written: Callable[[str], None] | None = None  # tests: fail mid-write

    # --- listing ------------------------------------------------------------------------------
    def _listing(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _CKPT.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    @property
    def checkpoints(self) -> list[str]:
        """Committed checkpoints, oldest first (not verified)."""
        return [str(p) for _, p in self._listing()]

    @property
    def latest(self) -> str | None:
        """The newest committed checkpoint (not verified; ``restore_or_initialize`` verifies)."""
        items = self._listing()
        return str(items[-1][1]) if items else None

    # --- save ---------------------------------------------------------------------------------
    def save(self, step: int | torch.Tensor | None = None) -> str:
        """Write a checkpoint of every replica's objects at ``step``; returns its path (everywhere)."""
        if step is None:
            step = self.checkpoint.objects.get("step")
        if step is None:
            raise ValueError("save(step): pass the step (or give the Checkpoint a `step` object)")
        step_int = int(step.item()) if isinstance(step, torch.Tensor) else int(step)
        if self.strategy.extended.shards_state:  # issue 14 hook: sharded state (train/checkpoint/sharded.py)
            from stratagem.train.checkpoint import sharded

            return sharded.save(self, step_int)
        mine = _payload(*self.checkpoint.encode(shared=None if self._all_per_rank else False))
        per_rank = self._comm.gather_object(mine, 0)  # to the writer only, not to everyone
        result: tuple[str, str] = ("", "")
        if per_rank is not None:
            try:
                shared = _payload(*({}, {}) if self._all_per_rank else self.checkpoint.encode(shared=True))
                path = write_checkpoint(
                    self.directory, step_int, shared, per_rank, on_file_written=self._on_file_written
                )
                self._prune()
                result = (str(path), "")
            except Exception as e:  # noqa: BLE001 - sent to every replica below
                result = ("", f"{type(e).__name__}: {e}")
        result = self._comm.broadcast_object(result, 0)
        if result[1]:
            raise RuntimeError(f"the chief could not write the checkpoint at step {step_int}: {result[1]}")
        return result[0]

    def _prune(self) -> None:
        for p in self.directory.glob(".tmp-ckpt-*"):  # left by a writer that died
            shutil.rmtree(p, ignore_errors=True)
        if self.max_to_keep is None:
            return
        items = self._listing()
        for _, p in items[: max(0, len(items) - self.max_to_keep)]:
            shutil.rmtree(p, ignore_errors=True)

    # --- restore ------------------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        """Load on every replica; a failure on any one is raised on all (no one waits alone)."""
        problem = ""
        try:
            self._load_here(path)
        except Exception as e:  # noqa: BLE001 - agreed on below, then raised everywhere
            problem = f"{type(e).__name__}: {e}"
            error: Exception = e
        problems = self._comm.all_gather_object(problem)
        if problem:
            raise error
        failed = [f"replica {r}: {p}" for r, p in enumerate(problems) if p]
        if failed:
            raise RuntimeError(f"restoring {path} failed on other replicas ({'; '.join(failed)})")

    def _load_here(self, path: Path) -> None:
        meta = read_metadata(path)
        if "sharded" in meta:  # issue 14 hook: a sharded checkpoint (train/checkpoint/sharded.py)
            from stratagem.train.checkpoint import sharded

            return sharded.load(self, path, meta)
        rank, world = self._comm.rank, self._comm.world_size
        if meta["world_size"] != world:
            raise ValueError(
                f"checkpoint {path} was written by {meta['world_size']} replicas; this job has "
                f"{world}. Per-replica state (RNG, data iterators) cannot be mapped; restore with "
                f"{meta['world_size']} replicas"
            )
        states = read_part(path, "shared", meta)
        states.update(read_part(path, f"rank-{rank}", meta))
        self.checkpoint.apply(states)

    def restore(self, path: str | os.PathLike[str]) -> None:
        """Load the checkpoint at ``path`` into the objects (every replica; verified first)."""
        p = Path(path)
        problem: tuple[str, str] = ("", "")
        if self._comm.rank == 0:
            try:
                verify(p)
            except CheckpointCorruptError as e:
                problem = (e.path, e.problem)
            except OSError as e:
                problem = (str(p), str(e))
        problem = self._comm.broadcast_object(problem, 0)
        if problem[0]:
            raise CheckpointCorruptError(problem[0], problem[1])
        self._load(p)
        self._comm.barrier()

    def restore_or_initialize(self) -> str | None:
        """Restore the newest checkpoint that verifies (skipping corrupt ones with a warning);
        None, leaving the objects as they are, when there is none."""
        chosen = ""
        if self._comm.rank == 0:
            for _, p in reversed(self._listing()):
                try:
                    verify(p)
                except CheckpointCorruptError as e:
                    warnings.warn(f"skipping checkpoint {p}: {e}", stacklevel=2)
                    continue
                chosen = str(p)
                break
        chosen = self._comm.broadcast_object(chosen, 0)
        if not chosen:
            return None
        self._load(Path(chosen))
        self._comm.barrier()
        return chosen
