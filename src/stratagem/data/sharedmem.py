"""Shared-memory arenas (anonymous memfd regions passed as file descriptors) and the layout of
elements and batches in them: one stacked region per component, small values pickled.

An arena has no name in any file system: it is freed by the kernel when the last process
mapping it ends, so a killed job leaves nothing behind. A batch handed to the consumer is a set
of tensors viewing its arena; when the last of them (and every view of them) is gone, a
finalizer reports the arena free so the worker can write the next batch into it (no fresh
pages to fault in per batch).
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stratagem.core.finalizers import interrupt_safe
from stratagem.data.structure import flatten, map_structure, pack_as

ALIGN = 64
ROUND = 1 << 20  # arenas are sized in whole MiB so slightly larger batches reuse them

# A leaf descriptor: ("T", dtype, shape, offset) torch / ("N", dtype, shape, offset) numpy,
# stacked over the elements of a task for inputs; ("P", value) pickled in the message.
Desc = tuple[Any, ...]
WHOLE = "whole"  # the skeleton of a task whose elements differ in structure (sent pickled)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """One shared region: created (``fd=None``) or mapped from a received descriptor."""

    def __init__(self, size: int, fd: int | None = None) -> None:
        own = fd is None
        if fd is None:
            size = max(ROUND, -(-size // ROUND) * ROUND)
            fd = os.memfd_create("stratagem-data", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.size = size
        self.mm = mmap.mmap(fd, size)
        self.fd: int | None = fd if own else None  # the creator sends it, then closes it
        if not own:
            os.close(fd)
        self.flat = torch.frombuffer(self.mm, dtype=torch.uint8)

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def region(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A writable tensor over ``[offset, offset + nbytes)``."""
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.flat[offset:offset + n].view(dtype).view(shape)

    def np_region(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self.mm, dtype=dtype, count=count, offset=offset).reshape(shape)


class Bump:
    """Bump allocation of aligned regions in an arena (``alloc`` returns None when full)."""

    def __init__(self, arena: Arena) -> None:
        self.arena, self.used = arena, 0
        self.placed: dict[int, int] = {}  # id(tensor) -> offset

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self.used + n > self.arena.size:
            return None
        t = self.arena.region(self.used, dtype, tuple(shape))
        self.placed[id(t)] = self.used
        self.used = _align(self.used + n)
        return t


def skeleton(element: Any) -> Any:
    return map_structure(lambda _: None, element)


def same_structure(a: Any, b: Any) -> bool:
    """Whether two elements have the same nesting (tuple/namedtuple/dict keys)."""
    if isinstance(a, tuple):
        return (type(b) is type(a) and len(a) == len(b)
                and all(same_structure(x, y) for x, y in zip(a, b)))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(same_structure(a[k], b[k]) for k in a))
    return not isinstance(b, tuple | dict)


def _owner(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class Sources:
    """Arrays and tensors the input pipeline held when the workers were forked: a worker has
    them at the same addresses (copy-on-write), so an element that views one of them (a
    ``from_tensor_slices`` row) travels as (source, offset, shape, strides), not bytes.
    Holding them here keeps their memory from being reused for other data."""

    def __init__(self, plan: Any) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.arrays: dict[int, np.ndarray] = {}
        seen: set[int] = set()
        stack = [plan]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.extend(getattr(node, "_inputs", ()))
            for value in vars(node).values():
                for v in value if isinstance(value, list | tuple) else (value,):
                    self._add(v)

    def _add(self, v: Any) -> None:
        if isinstance(v, torch.Tensor) and v.layout == torch.strided and v.device.type == "cpu":
            self.tensors[v.untyped_storage().data_ptr()] = v
        elif isinstance(v, np.ndarray) and v.dtype.kind in "biufc":
            owner = _owner(v)
            if owner.flags.c_contiguous:  # it must export its buffer in the worker
                self.arrays[id(owner)] = owner

    def find(self, leaf: Any) -> Desc | None:
        """("R", kind, key, offset, shape, strides, dtype) when ``leaf`` views a source."""
        if isinstance(leaf, torch.Tensor):
            if leaf.layout != torch.strided or leaf.device.type != "cpu":
                return None
            key = leaf.untyped_storage().data_ptr()
            if key not in self.tensors or leaf.requires_grad:
                return None
            return ("R", "t", key, leaf.storage_offset(), tuple(leaf.shape), leaf.stride(),
                    leaf.dtype)
        if isinstance(leaf, np.ndarray):
            owner = _owner(leaf)
            if id(owner) not in self.arrays:
                return None
            offset = leaf.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
            return ("R", "n", id(owner), offset, leaf.shape, leaf.strides, leaf.dtype)
        return None

    def get(self, d: Desc) -> Any:
        _, kind, key, offset, shape, strides, dtype = d
        if kind == "t":
            src = self.tensors[key]
            return torch.empty((0,), dtype=dtype).set_(
                src.untyped_storage(), offset, shape, strides)
        owner = self.arrays[key]
        return np.ndarray(shape, dtype, buffer=owner, offset=offset, strides=strides)


# -- inputs: main process -> worker --------------------------------------------------------
def _column_kind(column: list[Any]) -> tuple[str, Any, tuple[int, ...]] | None:
    first = column[0]
    if isinstance(first, torch.Tensor):
        if first.layout != torch.strided or first.is_cuda:
            return None
        shape, dtype = tuple(first.shape), first.dtype
        if all(isinstance(x, torch.Tensor) and x.dtype == dtype and tuple(x.shape) == shape
               for x in column):
            return "T", dtype, shape
    elif isinstance(first, np.ndarray) and first.dtype.kind in "biufc":
        shape, dtype = first.shape, first.dtype
        if all(isinstance(x, np.ndarray) and x.dtype == dtype and x.shape == shape
               for x in column):
            return "N", dtype, shape
    return None


def plan_inputs(elements: list[Any], sources: Sources | None) -> tuple[Any, list[Desc], int]:
    """(skeleton or WHOLE, column descriptors without data, bytes needed) for a task.

    A column whose leaves all view fork-time ``sources`` travels as references; columns of
    same-shape arrays/tensors are stacked into the arena; other leaves travel pickled.
    Elements of different structures travel whole (skeleton WHOLE, one column).
    """
    first = elements[0]
    nested = isinstance(first, tuple | dict)
    if nested and not all(same_structure(first, e) for e in elements[1:]):
        return WHOLE, [("P", list(elements))], 0
    skel = skeleton(first) if nested else None
    flats = [flatten(e) for e in elements] if nested else [[e] for e in elements]
    descs: list[Desc] = []
    offset = 0
    for j in range(len(flats[0])):
        column = [f[j] for f in flats]
        if sources is not None:
            refs = [sources.find(x) for x in column]
            if all(r is not None for r in refs):
                descs.append(("RS", refs))
                continue
        kind = _column_kind(column)
        if kind is None:
            descs.append(("P", column))
            continue
        k, dtype, shape = kind
        descs.append((k, dtype, shape, offset, column))
        itemsize = dtype.itemsize
        offset = _align(offset + len(column) * int(np.prod(shape, dtype=np.int64)) * itemsize)
    return skel, descs, offset


def write_inputs(descs: list[Desc], arena: Arena | None) -> list[Desc]:
    """Copy the stacked columns into ``arena``; returns the descriptors to send."""
    out: list[Desc] = []
    for d in descs:
        if d[0] in ("P", "RS"):
            out.append(d)
            continue
        kind, dtype, shape, offset, column = d
        assert arena is not None
        n = len(column)
        if kind == "T":
            torch.stack([x.detach() for x in column], out=arena.region(offset, dtype, (n, *shape)))
        else:
            np.stack(column, out=arena.np_region(offset, dtype, (n, *shape)))
        out.append((kind, dtype, shape, offset, n))
    return out


def read_inputs(
    skel: Any, descs: list[Desc], arena: Arena | None, sources: Sources | None
) -> list[Any]:
    """The task's elements, in the worker: views of the arena or the sources (no copy)."""
    if skel == WHOLE:
        return list(descs[0][1])
    columns: list[Any] = []
    for d in descs:
        if d[0] == "P":
            columns.append(d[1])
            continue
        if d[0] == "RS":
            assert sources is not None
            columns.append([sources.get(r) for r in d[1]])
            continue
        kind, dtype, shape, offset, n = d
        assert arena is not None
        if kind == "T":
            columns.append(arena.region(offset, dtype, (n, *shape)).unbind(0))
        else:
            columns.append(list(arena.np_region(offset, dtype, (n, *shape))))
    if skel is None:  # elements are single leaves
        return list(columns[0])
    n = len(columns[0]) if columns else 0
    return [pack_as(skel, [c[i] for c in columns]) for i in range(n)]


# -- outputs: worker -> main process -----------------------------------------------------
def batch_bytes(elements: list[Any]) -> int:
    """Bytes of a plain (unpadded) batch of ``elements``, from the first one."""
    total = 0
    for leaf in flatten(elements[0]):
        if isinstance(leaf, torch.Tensor):
            total += _align(leaf.element_size() * leaf.nelement() * len(elements))
        elif isinstance(leaf, np.ndarray | np.generic | int | float | bool):
            total += _align(np.asarray(leaf).nbytes * len(elements))
    return total + ALIGN


def describe_batch(batch: Any, bump: Bump) -> tuple[Any, list[Desc], int]:
    """(skeleton, descriptors, bytes still to place): tensors the collate wrote into the
    arena are described in place; other tensors need ``place_rest``; the rest is pickled."""
    descs: list[Desc] = []
    missing = 0
    for leaf in flatten(batch):
        if isinstance(leaf, torch.Tensor):
            offset = bump.placed.get(id(leaf))
            if offset is None:
                missing += _align(leaf.element_size() * leaf.nelement())
                descs.append(("?", leaf))
            else:
                descs.append(("T", leaf.dtype, tuple(leaf.shape), offset))
        else:
            descs.append(("P", leaf))
    return skeleton(batch), descs, missing


def place_rest(descs: list[Desc], bump: Bump) -> list[Desc]:
    """Copy the tensors not yet in the arena (``bump`` must have room for them)."""
    out = []
    for d in descs:
        if d[0] == "?":
            t = d[1]
            region = bump.alloc(tuple(t.shape), t.dtype)
            assert region is not None, "arena sized too small"
            region.copy_(t)
            out.append(("T", t.dtype, tuple(t.shape), bump.placed[id(region)]))
        else:
            out.append(d)
    return out


def read_batch(
    skel: Any, descs: list[Desc], arena: Arena, on_free: Callable[[], None]
) -> Any:
    """The batch as tensors viewing ``arena`` (main process); ``on_free`` runs once no
    tensor viewing it is left."""
    view = memoryview(arena.mm)
    leaves = []
    for d in descs:
        if d[0] == "P":
            leaves.append(d[1])
            continue
        _, dtype, shape, offset = d
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            leaves.append(torch.empty(shape, dtype=dtype))
        else:
            leaves.append(torch.frombuffer(view, dtype=dtype, count=count, offset=offset)
                          .view(shape))
    weakref.finalize(view, interrupt_safe(on_free))
    return pack_as(skel, leaves)
