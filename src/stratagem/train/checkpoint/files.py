"""The checkpoint file format: ``ckpt-<step>/`` with safetensors + JSON parts and a
``metadata.json`` (size and sha256 of every file, and of itself), written atomically (temporary
directory, fsync, rename) and read back safely (plain files inside the checkpoint only, sizes
checked before reading, hashes before decoding).

What the sha256 protects against: a file that was truncated, partly written, bit-flipped or
swapped with another checkpoint's file, by accident. What it does not: tampering. Whoever can
write the files can write a matching ``metadata.json`` too; a checkpoint from someone you do not
trust is safe to *read* (no pickle, no code runs, only plain files inside the checkpoint
directory, of the sizes declared, are opened) but its *values* are whatever they put there.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from stratagem.train.checkpoint.codec import CheckpointCorruptError, decode_value

FORMAT = "stratagem.checkpoint/1"

#: metadata.json larger than this is refused before it is read
MAX_METADATA_BYTES = 64 << 20
#: a file name the metadata may list: a plain name, optionally inside one plain sub-directory
_NAME = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.=-]{0,199}(/[A-Za-z0-9_.][A-Za-z0-9_.=-]{0,199})?")
_SHA = re.compile(r"[0-9a-f]{64}")


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


# --- reading: plain files only, sizes before bytes, hashes before decoding --------------------------
def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
    ):  # fmt: skip
        if test(mode):
            return name
    return "not a plain file"


def read_plain(path: Path, *, size: int | None = None, limit: int | None = None) -> bytes:
    """The bytes of ``path`` if it is a plain file (not a link, FIFO or device) of ``size`` bytes
    (or at most ``limit``); checked with fstat on the opened file before a byte is read."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)  # O_NONBLOCK: opening a FIFO does not wait for a writer
    except FileNotFoundError:
        raise CheckpointCorruptError(path, "it is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointCorruptError(
                path, "it is a symbolic link; a checkpoint is read only from plain files inside its directory"
            ) from None
        raise CheckpointCorruptError(path, f"it cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(
                path, f"it is {_kind(st.st_mode)}; a checkpoint is read only from plain files inside its directory"
            )
        if size is not None and st.st_size != size:
            raise CheckpointCorruptError(
                path, f"it has {st.st_size} bytes, metadata.json says {size} (truncated or replaced?)"
            )
        if limit is not None and st.st_size > limit:
            raise CheckpointCorruptError(path, f"it has {st.st_size} bytes, more than the {limit} allowed")
        want = st.st_size
        chunks = []
        got = 0
        while got < want:
            chunk = os.read(fd, min(want - got, 16 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got != want:
            raise CheckpointCorruptError(path, f"it shrank to {got} bytes while being read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _check_metadata(path: Path, meta: Any) -> None:
    """The structure a metadata.json must have; every listed name is a plain name inside."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointCorruptError(path, f"not a {FORMAT} metadata file")
    for key in ("step", "world_size"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool) or meta[key] < 0:
            raise CheckpointCorruptError(path, f"its {key!r} is {meta.get(key)!r}, not a non-negative integer")
    if meta["world_size"] < 1:
        raise CheckpointCorruptError(path, "its 'world_size' is 0")
    files = meta.get("files")
    if not isinstance(files, dict):
        raise CheckpointCorruptError(path, "its 'files' is not a mapping of file names")
    for name, info in files.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name or "." in name.split("/"):
            raise CheckpointCorruptError(
                path, f"it lists the file {name!r}, which is not a plain name inside the checkpoint directory"
            )
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("size"), int)
            or isinstance(info.get("size"), bool)
            or info["size"] < 0
            or not isinstance(info.get("sha256"), str)
            or not _SHA.fullmatch(info["sha256"])
        ):
            raise CheckpointCorruptError(path, f"its entry for {name!r} is not {{'size': int, 'sha256': hex}}")


def read_metadata(ckpt: Path) -> dict[str, Any]:
    """``metadata.json`` of a checkpoint: a plain file, checked against its own sha256 and its
    structure (every file it lists is a plain name inside the checkpoint)."""
    path = Path(ckpt) / "metadata.json"
    if not Path(ckpt).is_dir():
        raise CheckpointCorruptError(ckpt, "it is not a directory")
    try:
        raw = read_plain(path, limit=MAX_METADATA_BYTES)
    except CheckpointCorruptError as e:
        if e.problem == "it is missing":
            raise CheckpointCorruptError(path, "it is missing (the checkpoint was never committed)") from None
        raise
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorruptError(path, f"not valid JSON ({type(e).__name__}: {e})"[:300]) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointCorruptError(path, f"not a {FORMAT} metadata file")
    body = {k: v for k, v in meta.items() if k != "sha256"}
    if meta.get("sha256") != _sha256(_canonical(body)):
        raise CheckpointCorruptError(path, "its sha256 does not match its content (altered or truncated)")
    _check_metadata(path, meta)
    return meta


def file_path(ckpt: Path, name: str) -> Path:
    """The path of a listed file; its sub-directory (if any) must be a real directory."""
    if "/" in name:
        sub = ckpt / name.split("/", 1)[0]
        try:
            mode = os.lstat(sub).st_mode
        except FileNotFoundError:
            raise CheckpointCorruptError(sub, "it is missing") from None
        if not stat.S_ISDIR(mode):
            raise CheckpointCorruptError(sub, f"it is {_kind(mode)}, not a directory inside the checkpoint")
    return ckpt / name


def _read_verified(ckpt: Path, name: str, meta: dict[str, Any]) -> bytes:
    info = meta["files"].get(name)
    path = ckpt / name
    if info is None:
        raise CheckpointCorruptError(path, "it is not listed in metadata.json")
    data = read_plain(file_path(ckpt, name), size=int(info["size"]))
    if _sha256(data) != info["sha256"]:
        raise CheckpointCorruptError(path, "its sha256 does not match metadata.json (corrupted)")
    return data


def read_part(ckpt: Path, part: str, meta: dict[str, Any]) -> dict[str, Any]:
    """One part (``shared`` or ``rank-<r>``): verified, decoded to CPU values."""
    struct_raw = _read_verified(ckpt, f"{part}.json", meta)
    tensor_raw = _read_verified(ckpt, f"{part}.safetensors", meta)
    where = str(ckpt / f"{part}.json")
    try:
        struct = json.loads(struct_raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorruptError(where, f"not valid JSON ({type(e).__name__})") from None
    try:
        tensors = safetensors.torch.load(tensor_raw)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointCorruptError(ckpt / f"{part}.safetensors", f"not a safetensors file ({e})") from None
    if not isinstance(struct, dict):
        raise CheckpointCorruptError(where, "expected a JSON object")
    try:
        return {k: decode_value(v, tensors, where) for k, v in struct.items()}
    except RecursionError:
        raise CheckpointCorruptError(where, "its values are nested too deeply") from None
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointCorruptError(where, f"a value cannot be decoded ({type(e).__name__}: {e})") from None


def verify(ckpt: str | os.PathLike[str]) -> dict[str, Any]:
    """Check every file of a checkpoint against metadata.json; its metadata, or CheckpointCorruptError."""
    path = Path(ckpt)
    meta = read_metadata(path)
    for name in meta["files"]:
        _read_verified(path, name, meta)
    return meta


# --- writing: a temporary directory of this writer, renamed into place ------------------------------
def write_checkpoint(
    directory: Path,
    step: int,
    shared: tuple[bytes, bytes],
    per_rank: list[tuple[bytes, bytes]],
    *,
    on_file_written: Callable[[str], None] | None = None,
    writer: str | None = None,
) -> Path:
    """Write a checkpoint atomically (temporary directory, fsync, rename); returns its path.

    The temporary directory is named after ``writer`` (``lock.writer_tag()``: host and pid) so
    that only this writer, or a later one that knows it died, removes it. A write that fails
    (disk full, I/O error) removes its own temporary directory and leaves earlier checkpoints as
    they were."""
    directory.mkdir(parents=True, exist_ok=True)
    tag = writer or uuid.uuid4().hex[:8]
    final = directory / f"ckpt-{step}"
    tmp = directory / f".tmp-ckpt-{step}+{tag}+{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    old: Path | None = None
    committed = False
    try:
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
        if final.exists():  # re-saving a step: move the old one aside, delete it once replaced
            old = directory / f".old-ckpt-{step}+{tag}+{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        committed = True
        _fsync_dir(directory)
    finally:
        if not committed:
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and not final.exists():
                try:
                    os.rename(old, final)  # put the previous checkpoint of this step back
                    old = None
                except OSError:
                    pass
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final
