"""cache(): elements kept in memory or in a file (npy entries in a zip, no pickle), committed
atomically when an epoch completes."""

from __future__ import annotations

import json
import os
import secrets
import threading
import zipfile
from typing import Any

import numpy as np
import torch

from stratagem.core.finalizers import interrupt_safe
from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.sources import _IndexIterator
from stratagem.data.structure import flatten, from_json, map_structure, pack_as, to_json

_INDEX = "index.json"


def _encode(leaf: Any) -> tuple[np.ndarray, str]:
    if isinstance(leaf, torch.Tensor):
        if leaf.dtype == torch.bfloat16:
            raise TypeError("cache(filename) cannot store bfloat16 tensors; cast to float32")
        return leaf.detach().cpu().numpy(), "torch"
    if isinstance(leaf, np.ndarray):
        if leaf.dtype == object:
            raise TypeError("cache(filename) cannot store object arrays (it never pickles)")
        return leaf, "numpy"
    for kind in (bool, int, float, str, bytes):
        if isinstance(leaf, kind):
            return np.asarray(leaf), kind.__name__
    if isinstance(leaf, np.generic):
        return np.asarray(leaf), "npscalar"
    raise TypeError(
        f"cache(filename) cannot store a {type(leaf).__name__}; elements must be tensors, "
        "numpy arrays or Python scalars/strings"
    )


def _decode(arr: np.ndarray, kind: str) -> Any:
    if kind == "torch":
        return torch.from_numpy(np.array(arr))
    if kind == "numpy":
        return arr
    if kind == "npscalar":
        return arr[()]
    if kind == "bytes":
        return bytes(arr.item())
    return {"bool": bool, "int": int, "float": float, "str": str}[kind](arr.item())


class CacheDataset(Dataset):
    """Caches the first complete epoch; later epochs read the cache instead of the input.

    With a filename, elements are written to ``<filename>.tmp-<random>`` and renamed to
    ``filename`` only when the epoch completes: a partly read epoch leaves no cache file.
    A cache file that exists is read as is (delete it to rebuild).
    """

    def __init__(self, input_ds: Dataset, filename: str) -> None:
        self._inputs = (input_ds,)
        self._filename = os.fspath(filename)
        self._memory: list[Any] | None = None
        self._lock = threading.Lock()

    def _cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        if self._filename and os.path.exists(self._filename):
            return _FileReader(self._filename)
        if not self._filename and self._memory is not None:
            memory = self._memory
            return _ListReader(len(memory), memory.__getitem__)
        return _CacheWriter(self, self._inputs[0]._make_iterator(ctx.child(0)))


class _ListReader(_IndexIterator):
    """Reads a committed cache; its state also accepts one saved while the cache was written."""

    def state_dict(self) -> dict[str, Any]:
        return {"mode": "read", "index": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a state saved while the cache was being written counts input elements, which are
        # the cache's elements in the same order
        self.i = int(state["index"] if state.get("mode") == "read" else state["count"])


class CorruptCacheError(ValueError):
    """A cache file cannot be read: truncated, garbled, or not written by cache()."""


def _corrupt(path: str, what: str, exc: BaseException) -> CorruptCacheError:
    return CorruptCacheError(
        f"cache file {path!r} is corrupt ({what}: {type(exc).__name__}: {exc}); delete it "
        "so that cache() re-creates it from the input on the next complete epoch"
    )


class _FileReader(_ListReader):
    def __init__(self, path: str) -> None:
        self.path = path
        self.npz: Any = None
        try:
            self.npz = np.load(path, allow_pickle=False)
            if not hasattr(self.npz, "files"):
                raise ValueError("not a zip of npy entries")
            key = _INDEX.removesuffix(".json")
            if key not in self.npz.files:
                raise KeyError(f"no {key}.npy index entry")
            index = json.loads(bytes(self.npz[key]).decode())
            self.skeleton = from_json(index["skeleton"])
            self.kinds = index["kinds"]
            count = int(index["count"])
            if len(self.kinds) != count:
                raise ValueError(f"index lists {len(self.kinds)} elements, count is {count}")
        except Exception as e:
            if self.npz is not None and hasattr(self.npz, "close"):
                self.npz.close()
            raise _corrupt(path, "cannot read its index", e) from e
        super().__init__(count, self._element)

    def _element(self, i: int) -> Any:
        try:
            kinds = self.kinds[i]
            leaves = [_decode(self.npz[f"e{i}_{j}"], k) for j, k in enumerate(kinds)]
            return pack_as(self.skeleton, leaves)
        except Exception as e:
            raise _corrupt(self.path, f"cannot read element {i}", e) from e

    def close(self) -> None:
        if self.npz is not None:
            self.npz.close()


class _CacheWriter(StatefulIterator):
    def __init__(self, ds: CacheDataset, child: StatefulIterator) -> None:
        self.ds, self.child, self.children = ds, child, [child]
        self.count = 0
        self.recording = True
        self.elements: list[Any] = []
        self.zip: zipfile.ZipFile | None = None
        self.tmp = ""
        self.kinds: list[list[str]] = []
        self.skeleton: Any = None

    def _discard(self) -> None:
        """Remove this writer's own temporary file (never another writer's)."""
        zf, self.zip = self.zip, None
        if zf is not None:
            try:
                zf.close()
            except Exception:
                pass
        tmp, self.tmp = self.tmp, ""
        if tmp:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass

    @interrupt_safe
    def __del__(self) -> None:
        if getattr(self, "tmp", ""):
            try:
                self._discard()
            except Exception:
                pass

    def _write(self, element: Any) -> None:
        if self.zip is None:
            self.tmp = f"{self.ds._filename}.tmp-{secrets.token_hex(4)}"
            self.zip = zipfile.ZipFile(self.tmp, "w", zipfile.ZIP_STORED, allowZip64=True)
            self.skeleton = map_structure(lambda _: None, element)
        kinds = []
        for j, leaf in enumerate(flatten(element)):
            arr, kind = _encode(leaf)
            with self.zip.open(f"e{self.count}_{j}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)
            kinds.append(kind)
        self.kinds.append(kinds)

    def _commit(self) -> None:
        if not self.ds._filename:
            with self.ds._lock:
                if self.ds._memory is None:
                    self.ds._memory = self.elements
            return
        if self.zip is None:  # empty epoch
            self.tmp = f"{self.ds._filename}.tmp-{secrets.token_hex(4)}"
            self.zip = zipfile.ZipFile(self.tmp, "w")
        index = {"count": self.count, "skeleton": to_json(self.skeleton), "kinds": self.kinds}
        with self.zip.open(_INDEX.replace(".json", ".npy"), "w") as f:
            data = np.frombuffer(json.dumps(index).encode(), dtype=np.uint8)
            np.lib.format.write_array(f, data, allow_pickle=False)
        self.zip.close()
        self.zip = None
        with open(self.tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(self.tmp, self.ds._filename)
        self.tmp = ""  # committed: nothing of ours left to remove

    def __next__(self) -> Any:
        try:
            x = next(self.child)
        except StopIteration:
            if self.recording:
                self.recording = False
                try:
                    self._commit()
                except BaseException:
                    self._discard()
                    raise
            raise
        if self.recording:
            if self.ds._filename:
                try:
                    self._write(x)
                except BaseException:
                    self.recording = False
                    self._discard()
                    raise
            else:
                self.elements.append(x)
        self.count += 1
        return x

    def state_dict(self) -> dict[str, Any]:
        return {"mode": "write", "input": self.child.state_dict(), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recording = False  # a resumed epoch is partial: it does not fill the cache
        if state.get("mode") == "read":
            # saved while reading a cache that is gone (e.g. an in-memory cache in another
            # process): the cache held the input's epoch, so replay the input to that point
            for _ in range(int(state["index"])):
                next(self.child)
            self.count = int(state["index"])
            return
        self.child.load_state_dict(state["input"])
        self.count = int(state["count"])

    def close(self) -> None:
        self._discard()
        self.recording = False
        self.child.close()
