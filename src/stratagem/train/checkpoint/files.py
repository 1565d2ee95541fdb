"""The checkpoint file format: ``ckpt-<step>/`` with safetensors + JSON parts and a
``metadata.json`` (size and sha256 of every file, and of itself), written atomically (temporary
directory, fsync, rename) and read back verified."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from stratagem.train.checkpoint.codec import CheckpointCorruptError, decode_value

FORMAT = "stratagem.checkpoint/1"


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
    return {k: decode_value(v, tensors, str(ckpt / f"{part}.json")) for k, v in struct.items()}


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
