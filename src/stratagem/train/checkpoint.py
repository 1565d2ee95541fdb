"""Checkpoints: collective, atomic, safetensors + JSON with a sha256 per file, never pickle.

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

import base64
import hashlib
import json
import os
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch import nn

FORMAT = "stratagem.checkpoint/1"
_CKPT = re.compile(r"^ckpt-(\d+)$")


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated, altered or not in our format."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(f"checkpoint file {os.fspath(path)} is unusable: {problem}")
        self.path = os.fspath(path)
        self.problem = problem


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


# --- encoding: nested values <-> (JSON structure, flat tensors) ------------------------------------
def _encode(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": {"dtype": value.dtype.str, "shape": list(value.shape),
                                "data": value.reshape(-1).tolist()}}
    if isinstance(value, np.generic):
        return _encode(value.item(), tensors, path)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {"__dict__": [[_encode(k, tensors, path), _encode(v, tensors, f"{path}.{k}")]
                             for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).replace("torch.", "")}
    raise TypeError(
        f"cannot checkpoint {path}: a {type(value).__name__}; states may hold tensors, numpy "
        "arrays, numbers, strings, bytes, lists, tuples and dicts"
    )


def _decode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise CheckpointCorruptError(where, f"unexpected object with keys {sorted(value)[:5]}")
    (tag, body), = value.items()
    if tag == "__tensor__":
        if body not in tensors:
            raise CheckpointCorruptError(where, f"tensor {body!r} is missing from its .safetensors")
        return tensors[body]
    if tag == "__ndarray__":
        return np.asarray(body["data"], dtype=np.dtype(body["dtype"])).reshape(body["shape"])
    if tag == "__bytes__":
        return base64.b64decode(body)
    if tag == "__tuple__":
        return tuple(_decode(v, tensors, where) for v in body)
    if tag == "__dict__":
        return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in body}
    if tag == "__dtype__":
        dt = getattr(torch, str(body), None)
        if not isinstance(dt, torch.dtype):
            raise CheckpointCorruptError(where, f"unknown dtype {body!r}")
        return dt
    raise CheckpointCorruptError(where, f"unknown tag {tag!r}")


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
            name: _encode(_state_of(name, obj), tensors, name)
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


# --- files ----------------------------------------------------------------------------------------
def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _payload(struct: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[bytes, bytes]:
    return _canonical(struct), safetensors.torch.save(tensors)


def read_metadata(ckpt: Path) -> dict[str, Any]:
    """``metadata.json`` of a checkpoint, checked against its own sha256."""
    path = ckpt / "metadata.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorruptError(path, "it is missing (the checkpoint was never committed)") from None
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(path, f"not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointCorruptError(path, f"not a {FORMAT} metadata file")
    body = {k: v for k, v in meta.items() if k != "sha256"}
    if meta.get("sha256") != _sha256(_canonical(body)):
        raise CheckpointCorruptError(path, "its sha256 does not match its content (altered or truncated)")
    return meta


def _read_verified(ckpt: Path, name: str, meta: dict[str, Any]) -> bytes:
    info = meta["files"].get(name)
    path = ckpt / name
    if info is None:
        raise CheckpointCorruptError(path, "it is not listed in metadata.json")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorruptError(path, "it is missing") from None
    if len(data) != info["size"]:
        raise CheckpointCorruptError(path, f"it has {len(data)} bytes, metadata.json says {info['size']} (truncated?)")
    if _sha256(data) != info["sha256"]:
        raise CheckpointCorruptError(path, "its sha256 does not match metadata.json (corrupted)")
    return data


def read_part(ckpt: Path, part: str, meta: dict[str, Any]) -> dict[str, Any]:
    """One part (``shared`` or ``rank-<r>``): verified, decoded to CPU values."""
    struct_raw = _read_verified(ckpt, f"{part}.json", meta)
    tensor_raw = _read_verified(ckpt, f"{part}.safetensors", meta)
    try:
        struct = json.loads(struct_raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(ckpt / f"{part}.json", f"not valid JSON ({e})") from None
    try:
        tensors = safetensors.torch.load(tensor_raw)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointCorruptError(ckpt / f"{part}.safetensors", f"not a safetensors file ({e})") from None
    if not isinstance(struct, dict):
        raise CheckpointCorruptError(ckpt / f"{part}.json", "expected a JSON object")
    return {k: _decode(v, tensors, str(ckpt / f"{part}.json")) for k, v in struct.items()}


def verify(ckpt: str | os.PathLike[str]) -> dict[str, Any]:
    """Check every file of a checkpoint against metadata.json; its metadata, or CheckpointCorruptError."""
    path = Path(ckpt)
    meta = read_metadata(path)
    for name in meta["files"]:
        _read_verified(path, name, meta)
    return meta


def write_checkpoint(
    directory: Path,
    step: int,
    shared: tuple[bytes, bytes],
    per_rank: list[tuple[bytes, bytes]],
    *,
    on_file_written: Callable[[str], None] | None = None,
) -> Path:
    """Write a checkpoint atomically (temporary directory, fsync, rename); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"ckpt-{step}"
    tmp = directory / f".tmp-ckpt-{step}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    files: dict[str, dict[str, Any]] = {}
    parts = [("shared", shared)] + [(f"rank-{r}", p) for r, p in enumerate(per_rank)]
    for part, (struct, tensors) in parts:
        for name, data in ((f"{part}.json", struct), (f"{part}.safetensors", tensors)):
            _write(tmp / name, data)
            files[name] = {"size": len(data), "sha256": _sha256(data)}
            if on_file_written is not None:
                on_file_written(name)
    body = {"format": FORMAT, "step": step, "world_size": len(per_rank), "files": files}
    _write(tmp / "metadata.json", json.dumps({**body, "sha256": _sha256(_canonical(body))}, indent=1).encode())
    _fsync_dir(tmp)
    old = None
    if final.exists():  # re-saving a step: move the old one aside, delete it once replaced
        old = directory / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


# --- the manager ----------------------------------------------------------------------------------
def _strategy_parts(strategy: Any) -> tuple[Any, bool]:
    """The communicator of every process of ``strategy``, and whether every object is per-rank
    (pipeline stages hold different parameters; data-parallel replicas hold the same ones)."""
    from stratagem.distribute.data_parallel import DataParallelExtended
    from stratagem.distribute.pipeline_strategy import PipelineExtended

    ext = strategy.extended
    if isinstance(ext, DataParallelExtended):
        return ext.comm, False
    if isinstance(ext, PipelineExtended):
        return ext.world, True
    raise TypeError(f"CheckpointManager does not know {type(strategy).__name__}")


class CheckpointManager:
    """Saves ``checkpoint`` as ``directory/ckpt-<step>``, keeping the newest ``max_to_keep``.

    Every replica calls ``save``/``restore``/``restore_or_initialize`` (they are collective); the
    chief writes. ``strategy`` defaults to the strategy whose scope is open at construction (or
    the default strategy when none is and no process group exists). Restoring needs the
    directory on storage every worker can read.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 5,
        *,
        strategy: Any = None,
    ) -> None:
        from stratagem.distribute import context

        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        if strategy is None:
            if context.has_strategy():
                strategy = context.get_strategy()
            else:
                import torch.distributed as dist

                if dist.is_initialized() and dist.get_world_size() > 1:
                    raise ValueError(
                        "CheckpointManager: this process is one of a job of "
                        f"{dist.get_world_size()}; pass strategy=... or create the manager "
                        "inside strategy.scope()"
                    )
                strategy = context.get_strategy()
        self.checkpoint = checkpoint
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self.strategy = strategy
        self._comm, self._all_per_rank = _strategy_parts(strategy)
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
