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

import contextlib
import json
import numbers
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratagem.core.warn import warn_user
from stratagem.distribute import current, ownership
from stratagem.distribute.strategy import StateLayout, Strategy
from stratagem.train.checkpoint.codec import CheckpointCorruptError
from stratagem.train.checkpoint.files import (
    file_path,
    read_metadata,
    read_part,
    read_plain,
    verify,
)
from stratagem.train.checkpoint.lock import (
    CheckpointDirectoryLockedError,
    WriterLock,
    clean_leftovers,
    remove_checkpoint,
    replace_directory,
)
from stratagem.train.checkpoint.portable import PortableWriter
from stratagem.train.checkpoint.sharded import ShardedWriter
from stratagem.train.checkpoint.states import (
    apply_states,
    check_objects,
    encode_states,
    portable_states,
    validate_states,
)
from stratagem.train.checkpoint.ties import StageTies
from stratagem.train.checkpoint.writer import CheckpointWriter, WriteSite

_CKPT = re.compile(r"^ckpt-(\d+)$")

#: the writer for each way a strategy holds a model's state: whole files (the chief's, or each
#: pipeline stage's writer), or every process its own shards through torch.distributed.checkpoint
_WRITERS: dict[StateLayout, type[CheckpointWriter]] = {
    StateLayout.MIRRORED: PortableWriter,
    StateLayout.PER_RANK: PortableWriter,
    StateLayout.SHARDED: ShardedWriter,
}


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
        check_objects(objects)  # fail early on what cannot be saved
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
        check_directory(prefix.parent, f"Checkpoint.save({os.fspath(file_prefix)!r})")
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

            self.apply(portable_states(path, meta, self._objects, dist.get_rank(), dist.get_world_size()))
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
        return encode_states(self._objects, shared, ties)

    def apply(self, states: dict[str, Any]) -> None:
        """Load decoded ``states`` (every object's) into the objects: everything is validated
        first (keys, shapes, dtypes, structure), so a failed restore leaves the objects as they
        were (a per-replica object whose own ``load_state_dict`` fails is put back too)."""
        apply_states(self._objects, states)

    def validate(self, states: dict[str, Any]) -> None:
        """Raise (naming the object and the key) unless ``states`` fits every object."""
        validate_states(self._objects, states)


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
        check_directory(Path(directory), "CheckpointManager")
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
        self._layout = chosen.extended.state_layout
        self._on_file_written: Callable[[str], None] | None = None  # tests: fail mid-write
        # checkpoints restore_or_initialize found broken and skipped: not ``latest`` (until a
        # save writes that step again)
        self._skipped: set[str] = set()

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
        """Committed checkpoints, oldest first (not verified; those ``restore_or_initialize``
        found broken and skipped are left out)."""
        return [str(p) for _, p in self._listing() if str(p) not in self._skipped]

    @property
    def latest(self) -> str | None:
        """The newest committed checkpoint (not verified; ``restore_or_initialize`` verifies):
        after ``restore_or_initialize`` skipped a broken newer one, the one it restored."""
        items = self.checkpoints
        return items[-1] if items else None

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
        path = self._save(checked_step(step))
        self.checkpoint.save_counter.add_(1)  # as TensorFlow: every save counts
        return path

    def _save(self, step_int: int) -> str:
        self._skipped.discard(str(self.directory / f"ckpt-{step_int}"))  # written anew
        self._prepare_optimizers()
        if self._comm.rank != 0:
            # TensorFlow's other workers write a copy in their directory, which its tutorials
            # remove after each save (write_filepath, then rmtree): the directory exists here too
            with contextlib.suppress(OSError):
                self.directory.mkdir(parents=True, exist_ok=True)
        writer = _WRITERS[self._layout]()
        return writer.save(self._site(), step_int)

    def _site(self) -> WriteSite:
        """What a writer may use of this manager, for one save or restore."""
        return WriteSite(
            comm=self._comm,
            directory=self.directory,
            objects=self.checkpoint._objects,
            extended=self.strategy.extended,
            all_per_rank=self._layout is StateLayout.PER_RANK,
            own_directory=self._own_directory,
            agree=self._agree,
            prune=self._prune,
            on_file_written=self._on_file_written,
        )

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
        # a sharded checkpoint, or a model whose state is sharded: torch.distributed.checkpoint
        layout = StateLayout.SHARDED if "sharded" in meta else self._layout
        writer = _WRITERS[layout]()
        return writer.prepare(self._site(), path, meta)

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
        skipped: list[str] = []
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
                    skipped.append(str(p))
                    continue
                chosen = str(p)
                break
        self._agree(problem)
        chosen, skipped = self._comm.broadcast_object((chosen, skipped), 0)
        self._skipped.update(skipped)  # ``latest`` names what is restored, not a broken newer one
        if not chosen:
            return None
        self._load(Path(chosen))
        self._comm.barrier()
        return chosen


def checked_step(step: Any) -> int:
    """A checkpoint's step as an int: a non-negative whole number (an int, a numpy integer, an
    integer tensor of one element), else a ValueError/TypeError saying what was given. A
    negative step would be written as ``ckpt--1``, which no restore finds; ``2.5`` would be
    written as ``ckpt-2``."""
    value = step
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.dtype.is_floating_point or step.dtype.is_complex or step.dtype == torch.bool:
            raise TypeError(
                f"a checkpoint step must be a non-negative int; got a {step.dtype} tensor of shape "
                f"{tuple(step.shape)}: keep the step in an integer tensor (torch.tensor(0)) or pass an int"
            )
        value = step.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = f" (pass int({value!r}) if that is the step you mean)" if isinstance(value, float) and value.is_integer() else ""
        raise TypeError(
            f"a checkpoint step must be a non-negative int, got {value!r} ({type(value).__name__}){hint}; "
            "checkpoints are named ckpt-<step> and restored newest step first"
        )
    if value < 0:
        raise ValueError(
            f"a checkpoint step must be a non-negative int, got {value}: it would be written as "
            f"ckpt-{value}, which restore_or_initialize never finds; count steps from 0"
        )
    return int(value)


def check_directory(path: Path, what: str) -> None:
    """A clear error when ``path`` (a checkpoint directory, created when missing) is a file or
    lies inside one."""
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                where = f"{path} is a file" if p == path else f"{path} lies inside {p}, which is a file"
                raise ValueError(
                    f"{what}: the checkpoint directory {where}, not a directory; give a directory "
                    "path (it is created when missing) or move the file away"
                )
            return


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
