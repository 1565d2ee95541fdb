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

The chief holds the directory while it writes (``lock.WriterLock``: a second job is refused, a
dead one taken over); restore validates every state on every replica before assigning any; a
checkpoint restores into any strategy and number of replicas as ``portable_states`` says, and
``load_state_dict(path)`` gives a plain module's state dict in one call (docs/CHECKPOINTS.md).
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stratagem.core.warn import warn_user
from stratagem.distribute import current, ownership
from stratagem.distribute.strategy import Strategy
from stratagem.train.checkpoint import dtensors, optim_names
from stratagem.train.checkpoint.codec import CheckpointCorruptError, encode_value
from stratagem.train.checkpoint.files import (
    _payload,
    file_path,
    read_metadata,
    read_part,
    read_plain,
    verify,
    write_checkpoint,
)
from stratagem.train.checkpoint.lock import (
    CheckpointDirectoryLockedError,
    WriterLock,
    clean_leftovers,
    remove_checkpoint,
    replace_directory,
    writer_tag,
)
from stratagem.train.checkpoint.ties import StageTies

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
    is replaced: read it back as ``checkpoint.step``).

    TensorFlow's ``tf.train.Checkpoint`` calls: ``save(file_prefix)`` writes ``<prefix>-<n>``
    (n = ``save_counter``, counting saves from 1) and returns that path; ``restore(path)`` loads
    it and returns a status with ``assert_consumed()``. Both are collective under a strategy
    (every replica calls them; the chief writes)."""

    def __init__(self, **objects: Any) -> None:
        if not objects:
            raise ValueError("Checkpoint() needs at least one object, e.g. Checkpoint(model=model)")
        if "save_counter" in objects:
            raise ValueError(
                "Checkpoint(save_counter=...): save_counter is the checkpoint's own count of saves "
                "(as tf.train.Checkpoint's); give the object another name"
            )
        for name, obj in objects.items():
            _state_of(name, obj)  # fail early on what cannot be saved
        self._objects = dict(objects)
        self._save_counter = torch.zeros((), dtype=torch.int64)
        self._writers: dict[Path, CheckpointManager] = {}

    @property
    def save_counter(self) -> torch.Tensor:
        """How many times this checkpoint was saved (TensorFlow's ``save_counter``): ``save`` and
        ``CheckpointManager.save`` add one; a restore sets it to the restored checkpoint's number."""
        return self._save_counter

    def _writer(self, directory: Path) -> CheckpointManager:
        if directory not in self._writers:
            self._writers[directory] = CheckpointManager(self, directory, max_to_keep=None)
        return self._writers[directory]

    def save(self, file_prefix: str | os.PathLike[str]) -> str:
        """TensorFlow's ``checkpoint.save(file_prefix)``: add one to ``save_counter`` and write the
        checkpoint to ``<file_prefix>-<save_counter>`` (a directory, replacing one of that name);
        returns that path on every replica. Collective under a strategy (every replica calls it,
        the chief writes, as ``CheckpointManager.save``). TensorFlow's state file ``checkpoint``
        in the same directory names it, so ``latest_checkpoint(dir)`` returns it."""
        prefix = Path(file_prefix)
        if not prefix.name:
            raise ValueError(f"save({os.fspath(file_prefix)!r}): give a file prefix such as 'dir/ckpt'")
        number = int(self._save_counter) + 1
        target = prefix.with_name(f"{prefix.name}-{number}")
        # written as a manager's dir/ckpt-<n> (collective; the chief writes, and counts the save),
        # staged beside the prefix first when it is not named "ckpt"
        manager = self._writer(prefix.parent if prefix.name == "ckpt" else prefix.parent / _STAGING)
        staged = manager.save(number)
        result: tuple[str, str] = ("", "")
        if manager._comm.rank == 0:  # the writer moves it into place
            try:
                _commit(Path(staged), target)
            except OSError as e:
                result = (type(e).__name__, str(e))
        manager._agree(result)
        return os.fspath(target)

    def restore(self, save_path: str | os.PathLike[str] | None) -> CheckpointLoadStatus:
        """TensorFlow's ``checkpoint.restore(save_path)``: load the checkpoint at ``save_path``
        (from ``save``, ``CheckpointManager`` or ``ModelCheckpoint``; verified first) into the
        objects now, and set ``save_counter`` to its number. Under a strategy every replica
        calls it; outside any strategy, in a job of several processes, each process reads it
        on its own. ``save_path=None`` (no checkpoint yet) restores nothing.

        Differs from TensorFlow: a checkpoint that lacks one of the objects is an error here
        (TensorFlow restores the others and lets ``assert_consumed()`` fail)."""
        if save_path is None:
            return CheckpointLoadStatus(self, None)
        path = Path(save_path)
        if _outside_strategy_in_a_job(self):
            meta = verify(path)
            if "sharded" in meta:
                raise ValueError(f"{path} is a sharded checkpoint: restore it under the strategy that shards the model")
            import torch.distributed as dist

            self.apply(portable_states(path, meta, self, dist.get_rank(), dist.get_world_size()))
            self._restored(int(meta["step"]))
        else:
            self._writer(path.parent).restore(path)
        return CheckpointLoadStatus(self, path)

    def _restored(self, number: int) -> None:
        self._save_counter.fill_(number)

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint has no object {name!r} (it has {sorted(objects)})")

    @property
    def objects(self) -> dict[str, Any]:
        return dict(self._objects)

    def encode(
        self, shared: bool | None, ties: StageTies | None = None
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The shared (or per-replica, or with None all) objects' states as a JSON structure
        and flat tensors; ``ties``: a pipeline stage's weights tied to other stages' (written
        once, by the lowest stage holding each)."""
        tensors: dict[str, torch.Tensor] = {}
        struct = {}
        names = optim_names.parameter_names(self._objects.values())
        for name, obj in self._objects.items():
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

    def apply(self, states: dict[str, Any]) -> None:
        """Load decoded ``states`` (every object's) into the objects: everything is validated
        first (keys, shapes, dtypes, structure), so a failed restore leaves the objects as they
        were (a per-replica object whose own ``load_state_dict`` fails is put back too)."""
        self.validate(states)
        done: list[tuple[Any, Any]] = []
        # objects the validation cannot see into first (rolled back on failure), then the RNG,
        # optimizers and modules (validated fully above)
        order = sorted(self._objects.items(), key=lambda kv: _apply_rank(kv[1]))
        try:
            for name, obj in order:
                state = states[name]
                if isinstance(obj, torch.Tensor):
                    with torch.no_grad():
                        obj.copy_(state)
                elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
                    self._objects[name] = type(obj)(state)
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

    def validate(self, states: dict[str, Any]) -> None:
        """Raise (naming the object and the key) unless ``states`` fits every object."""
        missing = [n for n in self._objects if n not in states]
        if missing:
            raise KeyError(
                f"the checkpoint has no state for {missing} (it has {sorted(states)}); restore "
                "with a Checkpoint of the same objects"
            )
        for name, obj in self._objects.items():
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


#: Where ``Checkpoint.save`` stages a save before renaming it to ``<prefix>-<n>``.
_STAGING = ".stratagem-checkpoint-save"


def _commit(staged: Path, target: Path) -> None:
    """On the writer: the staged checkpoint renamed to ``target`` unless written there (one already
    there moved aside first, removed once replaced) and TensorFlow's state file naming it."""
    from stratagem.train.callbacks import _write_state_file  # callbacks imports this module

    if staged != target:
        replace_directory(staged, target)
    _write_state_file(target.parent, target, [target])


def _outside_strategy_in_a_job(checkpoint: Checkpoint) -> bool:
    """No strategy owns the objects nor has its scope open, and this process is one of several."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return False
    models = {n: o for n, o in checkpoint.objects.items() if isinstance(o, (nn.Module, torch.optim.Optimizer))}
    open_scope = current.get_strategy() if current.has_strategy() else None
    return ownership.resolve(models, None, open_scope, "Checkpoint.restore") is None


class CheckpointLoadStatus:
    """What ``Checkpoint.restore`` returns (TensorFlow's load status). The objects are restored
    when ``restore`` returns; the assertions check what TensorFlow's do."""

    def __init__(self, checkpoint: Checkpoint, path: Path | None) -> None:
        self._checkpoint = checkpoint
        self._path = path

    def _saved_names(self) -> set[str]:
        assert self._path is not None
        meta = read_metadata(self._path)
        names: set[str] = set()
        for part in ["shared"] + [f"rank-{r}" for r in range(int(meta["world_size"]))]:
            if f"{part}.json" in meta["files"]:
                names |= set(json.loads(read_plain(file_path(self._path, f"{part}.json"))))
        return names

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Raise AssertionError unless every object saved in the checkpoint was restored into
        one of this Checkpoint's (every one of this Checkpoint's was: restore raises otherwise)."""
        if self._path is None:
            raise AssertionError("No checkpoint specified (save_path=None); nothing is being restored.")
        unmatched = sorted(self._saved_names() - set(self._checkpoint.objects))
        if unmatched:
            raise AssertionError(
                f"Unresolved object in checkpoint {self._path}: {unmatched} (this Checkpoint has "
                f"{sorted(self._checkpoint.objects)})"
            )
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Every object of this Checkpoint was restored (always true once restore returned)."""
        if self._path is None:
            raise AssertionError("No checkpoint specified (save_path=None); nothing is being restored.")
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        return self.assert_existing_objects_matched()

    def expect_partial(self) -> CheckpointLoadStatus:
        return self

    def run_restore_ops(self, session: Any = None) -> None:
        """Nothing to run: the values were assigned by ``restore``."""

    def initialize_or_restore(self, session: Any = None) -> None:
        """Nothing to run: the values were assigned by ``restore``."""


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

    # --- ownership ----------------------------------------------------------------------------
    def _own_directory(self) -> None:
        """On the writer: hold the directory's lock (once; a live other writer is an error)."""
        lock = WriterLock.of(self.directory)
        lock.acquire()
        lock.check()

    def close(self) -> None:
        """Give the directory up now (it is given up at exit otherwise)."""
        WriterLock.of(self.directory).release()

    def _agree(self, problem: tuple[str, str]) -> None:
        """Raise on every replica what the chief met (a lock error as itself)."""
        kind, text = self._comm.broadcast_object(problem, 0)
        if kind == "CheckpointDirectoryLockedError":
            raise CheckpointDirectoryLockedError(text)
        if kind:
            raise RuntimeError(f"{kind}: {text}")

    # --- listing ------------------------------------------------------------------------------
    def _listing(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _CKPT.match(p.name)
            if m and p.is_dir() and not p.is_symlink():
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

    @property
    def latest_checkpoint(self) -> str | None:
        """TensorFlow's name for ``latest``: ``checkpoint.restore(manager.latest_checkpoint)``."""
        return self.latest

    # --- save ---------------------------------------------------------------------------------
    def save(self, step: int | torch.Tensor | None = None) -> str:
        """Write a checkpoint of every replica's objects at ``step``; returns its path (everywhere).

        Without ``step``: the Checkpoint's ``step`` object if it has one, else (TensorFlow's
        ``checkpoint_number=None``) its ``save_counter`` + 1, so saves are numbered 1, 2, ...
        Every save adds one to ``save_counter``.

        The chief holds the directory (``CheckpointDirectoryLockedError`` if another live job
        does). A save that fails (disk full, an I/O error, a value that cannot be encoded) raises
        on every replica, removes its own temporary files and leaves earlier checkpoints and
        later saves working."""
        if step is None:
            step = self.checkpoint.objects.get("step")
        if step is None:  # TensorFlow's checkpoint_number=None: the checkpoint's save_counter
            step = int(self.checkpoint.save_counter) + 1
        step_int = int(step.item()) if isinstance(step, torch.Tensor) else int(step)
        path = self._save(step_int)
        self.checkpoint.save_counter.add_(1)  # as TensorFlow: every save counts
        return path

    def _save(self, step_int: int) -> str:
        self._prepare_optimizers()
        if self.strategy.extended.shards_state:  # issue 14 hook: sharded state (train/checkpoint/sharded.py)
            from stratagem.train.checkpoint import sharded

            return sharded.save(self, step_int)
        try:
            ties = StageTies.of(self.strategy.extended)  # weights tied across pipeline stages
            mine: tuple[bytes, bytes] | None = _payload(
                *self.checkpoint.encode(shared=None if self._all_per_rank else False, ties=ties)
            )
            encode_error = ""
        except (TypeError, ValueError) as e:
            mine, encode_error = None, f"{type(e).__name__}: {e}"
        per_rank = self._comm.gather_object((mine, encode_error), 0)  # to the writer only
        result: tuple[str, str, str] = ("", "", "")
        if per_rank is not None:
            try:
                bad = [f"replica {r}: {err}" for r, (_, err) in enumerate(per_rank) if err]
                if bad:
                    raise TypeError(f"a state cannot be encoded ({'; '.join(bad)})")
                self._own_directory()
                shared = _payload(*({}, {}) if self._all_per_rank else self.checkpoint.encode(shared=True))
                path = write_checkpoint(
                    self.directory, step_int, shared, [m for m, _ in per_rank],  # type: ignore[misc]
                    on_file_written=self._on_file_written, writer=writer_tag(),
                )  # fmt: skip
                self._prune()
                result = (str(path), "", "")
            except Exception as e:  # noqa: BLE001 - sent to every replica below
                result = ("", type(e).__name__, f"{e}")
        result = self._comm.broadcast_object(result, 0)
        if result[1] == "CheckpointDirectoryLockedError":
            raise CheckpointDirectoryLockedError(result[2])
        if result[1]:
            raise RuntimeError(
                f"the chief could not write the checkpoint at step {step_int} in {self.directory}: "
                f"{result[1]}: {result[2]} (earlier checkpoints are intact; nothing of this save was left)"
            )
        self.strategy.extended.checkpoint_saved(result[0])
        return result[0]

    def _prepare_optimizers(self) -> None:
        """The strategy readies each optimizer before its state is read or written (a sharding
        strategy retargets it; a parameter-server strategy reads its state from the ps tasks)."""
        for obj in self.checkpoint.objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                self.strategy.extended.prepare_optimizer(obj)

    def _prune(self) -> None:
        clean_leftovers(self.directory)  # only what dead writers of this host left
        if self.max_to_keep is None:
            return
        items = self._listing()
        for step, p in items[: max(0, len(items) - self.max_to_keep)]:
            remove_checkpoint(p, step)

    # --- restore ------------------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        """Read and validate on every replica; assign only when every replica's validation
        passed (a failure on any one is raised on all, and no replica's objects change)."""
        problem = ""
        apply: Callable[[], None] | None = None
        try:
            apply = self._prepare(path)
        except Exception as e:  # noqa: BLE001 - agreed on below, then raised everywhere
            problem = f"{type(e).__name__}: {e}"
            error: Exception = e
        problems = self._comm.all_gather_object(problem)
        if problem:
            raise error
        failed = [f"replica {r}: {p}" for r, p in enumerate(problems) if p]
        if failed:
            raise RuntimeError(f"restoring {path} failed on other replicas ({'; '.join(failed)}); nothing was changed")
        assert apply is not None
        apply()
        self.checkpoint._restored(int(read_metadata(path)["step"]))

    def _prepare(self, path: Path) -> Callable[[], None]:
        """Read this replica's states from ``path`` and validate them; returns the assignment."""
        meta = read_metadata(path)
        self._prepare_optimizers()
        if "sharded" in meta or self.strategy.extended.shards_state:  # issue 14 hook: sharded checkpoint or model (train/checkpoint/sharded.py)
            from stratagem.train.checkpoint import sharded

            return sharded.prepare(self, path, meta)
        states = portable_states(path, meta, self.checkpoint, self._comm.rank, self._comm.world_size)
        ties = StageTies.of(self.strategy.extended)
        if ties is not None:  # a tied weight, written once, restores every stage's end
            for name, obj in self.checkpoint.objects.items():
                if isinstance(obj, nn.Module) and isinstance(states.get(name), dict):
                    states[name] = ties.restored(name, obj, states[name])
        self.checkpoint.validate(states)
        return lambda: self.checkpoint.apply(states)

    def restore(self, path: str | os.PathLike[str]) -> None:
        """Load the checkpoint at ``path`` into the objects (every replica; verified first).

        A checkpoint written under any strategy and number of replicas restores here: modules
        and optimizers always (a pipeline's stages are joined; a stage takes its layers), the
        per-replica objects as ``portable_states`` says."""
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
        """Take the directory as this job's (the chief holds its lock), restore the newest
        checkpoint that verifies (skipping corrupt ones with a warning); None, leaving the
        objects as they are, when there is none."""
        chosen = ""
        problem: tuple[str, str] = ("", "")
        if self._comm.rank == 0:
            try:
                self._own_directory()
            except (CheckpointDirectoryLockedError, OSError) as e:
                problem = (type(e).__name__, str(e))
            for _, p in reversed(self._listing()) if not problem[0] else []:
                try:
                    verify(p)
                except CheckpointCorruptError as e:
                    warn_user(f"skipping checkpoint {p}: {e}", stacklevel=2)
                    continue
                chosen = str(p)
                break
        self._agree(problem)
        chosen = self._comm.broadcast_object(chosen, 0)
        if not chosen:
            return None
        self._load(Path(chosen))
        self._comm.barrier()
        return chosen


# --- portability: any checkpoint into any job ------------------------------------------------------
def portable_states(
    path: Path, meta: dict[str, Any], checkpoint: Checkpoint, rank: int, world: int
) -> dict[str, Any]:
    """The state of every object of ``checkpoint`` for replica ``rank`` of ``world``, from a
    checkpoint written by ``meta["world_size"]`` processes under any strategy.

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
    names = optim_names.parameter_names(checkpoint.objects.values())
    what = f"checkpoint {path}"

    def elsewhere(obj: Any, state: Any) -> bool:
        """An optimizer's state saved over other parameters (another split): matched by name."""
        return isinstance(obj, torch.optim.Optimizer) and optim_names.needs_rekey(state, obj, names)

    for name, obj in checkpoint.objects.items():
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
        states[name] = checkpoint.objects[name].state_dict()
    rngs = sorted(n for n, o in checkpoint.objects.items() if isinstance(o, RNGState))
    if world > saved_world and rngs:  # said once, for the job, by rank 0
        warn_user(
            f"checkpoint {path} has the RNG streams of {saved_world} replicas; replicas "
            f"{saved_world}..{world - 1} of {world} keep their own {', '.join(map(repr, rngs))}",
            stacklevel=3,
        )
    return states


def _resolve(path: str | os.PathLike[str]) -> Path:
    """A checkpoint (``ckpt-<step>``), or a manager's directory (its newest that verifies)."""
    p = Path(path)
    if (p / "metadata.json").exists() or _CKPT.match(p.name):
        return p
    found = sorted(
        (int(m.group(1)), q) for q in (p.iterdir() if p.is_dir() else []) if (m := _CKPT.match(q.name)) and q.is_dir()
    )
    for _, q in reversed(found):
        try:
            verify(q)
        except CheckpointCorruptError:
            continue
        return q
    raise FileNotFoundError(f"{p} holds no checkpoint that verifies (expected ckpt-<step> directories)")


def load_state_dict(path: str | os.PathLike[str], name: str = "model") -> dict[str, torch.Tensor]:
    """The ordinary ``state_dict`` of the module saved as ``name``, for ``module.load_state_dict``.

    ``path`` is a checkpoint or a CheckpointManager's directory (its newest that verifies). Needs
    no strategy and no process group; a pipeline's stages are joined into the whole model."""
    ckpt = _resolve(path)
    meta = verify(ckpt)
    shared = read_part(ckpt, "shared", meta)
    if name in shared:
        state = shared[name]
    else:
        state = {}
        for r in range(int(meta["world_size"])):
            for k, v in read_part(ckpt, f"rank-{r}", meta).get(name, {}).items():
                state.setdefault(k, v)
        if not state:
            names = sorted(shared) + sorted(read_part(ckpt, "rank-0", meta))
            raise KeyError(f"checkpoint {ckpt} has no {name!r} (it has {sorted(set(names))})")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise TypeError(f"{name!r} in checkpoint {ckpt} is not a module's state dict")
    return dict(state)


def export_safetensors(path: str | os.PathLike[str], out: str | os.PathLike[str], name: str = "model") -> str:
    """Write the weights of the module saved as ``name`` to one plain ``.safetensors`` file."""
    import safetensors.torch

    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, v in load_state_dict(path, name).items():
        # a tied weight (one tensor under two names): safetensors refuses shared tensors
        state[k] = v.contiguous() if id(v) not in seen else v.clone()
        seen.add(id(v))
    safetensors.torch.save_file(state, os.fspath(out))
    return os.fspath(out)
