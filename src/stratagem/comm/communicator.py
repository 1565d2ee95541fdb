"""Collectives on nested values over torch.distributed, with finite timeouts and named failures.

``Communicator`` is the one interface the layers above use; ``LocalCommunicator`` is the job of
one process (every collective is the identity), ``ProcessGroupCommunicator`` wraps a
torch.distributed process group (gloo on CPU, NCCL on CUDA). Structured collectives coalesce the
leaves of a nested value into one flat buffer per dtype, and, when asked to, first check that
every replica passed the same structure, shapes and dtypes, so a mismatch is an error on every
replica instead of a hang or a silently wrong sum.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import os
import socket
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from stratagem.comm.errors import CollectiveError, ReplicaMismatchError, WorkerFailedError
from stratagem.comm.failure import FailureProbe, classify_failure, giving_up_allowed, in_collective
from stratagem.comm.sequence import CollectiveLog, describe
from stratagem.core import tree
from stratagem.core.eager import eager_only

OPS = ("sum", "mean", "max", "min")
_DIST_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def value_digest(value: Any) -> int:
    """A 31-bit digest of the bytes of every leaf of ``value``, in order (``check_same_values``
    compares the leaves one by one; a vote can carry this one number)."""
    leaves, _ = tree.flatten(value)
    return zlib.crc32(b"".join(_crc(x).to_bytes(4, "little") for x in leaves)) & 0x7FFFFFFF


def _crc(x: Any) -> int:
    """CRC-32 of a leaf's bytes (a tensor's contents, else its repr)."""
    if isinstance(x, torch.Tensor):
        flat = (x.to_dense() if x.is_sparse else x).detach().reshape(-1).contiguous().cpu()
        return zlib.crc32(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else 0
    return zlib.crc32(repr(x).encode())


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, bool):
        return torch.tensor(x, dtype=torch.bool)
    if isinstance(x, int):
        return torch.tensor(x, dtype=torch.int64)
    if isinstance(x, float):
        return torch.tensor(x, dtype=torch.float64)
    try:
        return torch.as_tensor(x)
    except Exception as e:  # noqa: BLE001
        raise TypeError(
            f"cannot communicate a value of type {type(x).__name__}; pass tensors, numbers or "
            "numpy arrays (nested in tuples, lists or dicts)"
        ) from e


def _divide(t: torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t / n
    return torch.div(t, n, rounding_mode="floor")


class Communicator(abc.ABC):
    """Collectives among the ``world_size`` processes of one group; every member must call."""

    rank: int
    world_size: int
    device: torch.device

    # --- primitives (tensors) -------------------------------------------------------------
    @abc.abstractmethod
    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """Reduce ``tensor`` in place across the group (``op`` in sum/max/min)."""

    @abc.abstractmethod
    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        """Start a sum all-reduce of ``tensor`` in place; returns an object with ``wait()``."""

    @abc.abstractmethod
    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``tensor`` (same shape everywhere), in rank order."""

    @abc.abstractmethod
    def all_gather_async(self, tensor: torch.Tensor, out: list[torch.Tensor]) -> Any:
        """Start gathering every member's ``tensor`` into ``out`` (one tensor per member, in rank
        order); returns an object with ``wait()``."""

    @abc.abstractmethod
    def all_to_all_async(
        self, send: torch.Tensor, recv: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]
    ) -> Any:
        """Start sending ``send``'s elements (contiguous, taken flat in rank order: ``send_splits[r]``
        of them to member ``r``) and receiving each member ``r``'s part for this one,
        ``recv_splits[r]`` elements, into ``recv`` (contiguous, flat, in rank order); returns an
        object with ``wait()``."""

    @abc.abstractmethod
    def all_to_all(
        self, send: torch.Tensor, recv: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]
    ) -> None:
        """``all_to_all_async`` waited for (given up on, like the other blocking collectives, once
        a peer is known lost)."""

    @abc.abstractmethod
    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` with the one on ``src``."""

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's picklable ``obj`` (small metadata only), in rank order."""

    @abc.abstractmethod
    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every member's picklable ``obj`` in rank order on ``dst`` (None elsewhere)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every member gets here."""

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to group rank ``dst``."""

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive into ``tensor`` from group rank ``src``."""

    @abc.abstractmethod
    def split(self, groups: Sequence[Sequence[int]]) -> Communicator:
        """Sub-groups (lists of ranks of this group, disjoint, covering it); returns this
        process's. Every member must call with the same ``groups``."""

    # --- structured collectives ------------------------------------------------------------
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.all_gather_object(obj if self.rank == src else None)[src]

    def check_same(self, what: str, value: Any) -> None:
        """Raise ReplicaMismatchError on every member unless all passed alike values."""
        if self.world_size == 1:
            return
        sig = tree.signature(value)
        code = torch.tensor([zlib.crc32(sig.encode()), len(sig)], dtype=torch.int64, device=self.device)
        codes = self.all_gather_tensor(code)
        if all(torch.equal(c, codes[0]) for c in codes):
            return
        sigs = self.all_gather_object(sig)
        listing = "; ".join(f"replica {r}: {s}" for r, s in enumerate(sigs))
        raise ReplicaMismatchError(
            f"{what} was called with different structures, shapes or dtypes on different "
            f"replicas ({listing}); every replica must pass the same structure and shapes"
        )

    def check_same_values(self, what: str, value: Any, mismatch: str) -> None:
        """``check_same``, then ReplicaMismatchError(``mismatch``) on every member unless every
        member's leaves hold the same bytes (a CRC-32 per leaf, gathered: order-sensitive, exact)."""
        self.check_same(what, value)
        if self.world_size == 1:
            return
        leaves, _ = tree.flatten(value)
        code = torch.tensor([_crc(x) for x in leaves], dtype=torch.int64, device=self.device)
        if not all(torch.equal(c, code) for c in self.all_gather_tensor(code)):
            raise ReplicaMismatchError(mismatch)

    def check_same_once(self, what: str, value: Any, site: Hashable | None) -> None:
        """``check_same`` on the first call from ``site`` (a call site every member names alike,
        e.g. the user's file and line); later calls from the same site are not checked, so a
        steady-state reduction is one collective. ``site=None`` checks every call."""
        if self.world_size == 1:
            return
        seen: set[Hashable] = self.__dict__.setdefault("_checked_sites", set())
        if site is not None and (what, site) in seen:
            return
        self.check_same(what, value)
        if site is not None:
            seen.add((what, site))

    def all_reduce(self, value: Any, op: str = "sum", *, check: bool = True, site: Hashable | None = None) -> Any:
        """``value`` (tensors or numbers, nested) reduced across the group; new tensors.

        ``check`` first verifies that every member passed the same structure, shapes and dtypes
        (on every call, or with ``site`` on the first call from that site)."""
        if op not in OPS:
            raise ValueError(f"unknown reduction {op!r}; use one of {OPS}")
        leaves, treedef = tree.flatten(value)
        tensors = [_as_tensor(x) for x in leaves]
        if check:
            self.check_same_once("all_reduce", tree.unflatten(treedef, tensors), site)
        out = self._reduce_leaves(tensors, op)
        return tree.unflatten(treedef, out)

    def _reduce_leaves(self, tensors: list[torch.Tensor], op: str) -> list[torch.Tensor]:
        if self.world_size == 1:
            return [t.clone() for t in tensors]
        out: list[torch.Tensor | None] = [None] * len(tensors)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            parts = [tensors[i].detach().to(self.device).reshape(-1) for i in idx]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            if dtype == torch.bool:
                flat = flat.to(torch.uint8)
            self.all_reduce_(flat, "sum" if op == "mean" else op)
            if dtype == torch.bool:
                flat = flat.bool()
            if op == "mean":
                flat = _divide(flat, self.world_size)
            offset = 0
            for i in idx:
                t = tensors[i]
                n = t.numel()
                out[i] = flat[offset : offset + n].view(t.shape).to(t.device)
                offset += n
        return [t for t in out if t is not None]

    def gather_varlen(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every member's ``tensor`` along ``dim``; sizes along ``dim`` may differ."""
        if self.world_size == 1:
            return tensor
        t = tensor.movedim(dim, 0) if tensor.dim() else tensor.reshape(1)
        sizes = self.all_gather_tensor(torch.tensor([t.shape[0]], dtype=torch.int64, device=self.device))
        longest = int(max(int(s) for s in sizes))
        padded = torch.zeros((longest, *t.shape[1:]), dtype=t.dtype, device=self.device)
        padded[: t.shape[0]] = t.to(self.device)
        parts = self.all_gather_tensor(padded)
        cat = torch.cat([p[: int(s)] for p, s in zip(parts, sizes)])
        return cat.to(tensor.device).movedim(0, dim) if tensor.dim() else cat.to(tensor.device)

    def broadcast_tensors_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` with ``src``'s, one flat message per dtype."""
        if self.world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).to(self.device) for t in group])
            self.broadcast_(flat, src)
            offset = 0
            with torch.no_grad():
                for t in group:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view(t.shape))
                    offset += n


eager_only(Communicator, ["broadcast_object", "check_same", "check_same_once", "all_reduce", "gather_varlen", "broadcast_tensors_"])


class LocalCommunicator(Communicator):
    """The group of one process: every collective returns what it was given."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.rank = 0
        self.world_size = 1
        self.device = torch.device(device)

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> None:
        return None

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        return _Done()

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def all_gather_async(self, tensor: torch.Tensor, out: list[torch.Tensor]) -> Any:
        out[0].copy_(tensor)
        return _Done()

    def all_to_all_async(
        self, send: torch.Tensor, recv: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]
    ) -> Any:
        self.all_to_all(send, recv, send_splits, recv_splits)
        return _Done()

    def all_to_all(
        self, send: torch.Tensor, recv: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]
    ) -> None:
        recv.view(-1).copy_(send.reshape(-1)[: recv.numel()])

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return [obj]

    def barrier(self) -> None:
        return None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        raise CollectiveError("a job of one process has no peer to send to")

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        raise CollectiveError("a job of one process has no peer to receive from")

    def split(self, groups: Sequence[Sequence[int]]) -> Communicator:
        return self


class _Done:
    def wait(self) -> bool:
        return True


#: every ProcessGroupCommunicator alive in this process (held weakly): what ``release_groups``
#: tears down at exit, without looking anywhere else
_live_groups: weakref.WeakSet[ProcessGroupCommunicator] = weakref.WeakSet()

#: (group, work) of collectives given up on (a peer fell silent): held so that neither is
#: destroyed while the work waits inside gloo for the lost peer (destroying the group would wait
#: for it); it ends by itself at the group's timeout
_abandoned: list[tuple[Any, Any]] = []



#: every torch DeviceMesh stratagem made (held weakly): they hold their process groups too
_live_meshes: weakref.WeakSet[Any] = weakref.WeakSet()


def owned_mesh(mesh: Any) -> Any:
    """``mesh`` (a torch DeviceMesh stratagem made), remembered so that ``release_groups`` makes
    it let go of its process groups at exit; returns it."""
    _live_meshes.add(mesh)
    return mesh


def release_groups() -> None:
    """Every live communicator and torch DeviceMesh stratagem made lets go of its process groups
    (at exit, after the groups are destroyed), so their C++ objects (gloo's threads) go while the
    interpreter is whole.

    A torch DeviceMesh (torch >= 2.10) keeps its groups in ``_pg_registry``, and DTensor's
    sharding-propagation cache keeps every mesh a DTensor op saw, for the life of the process:
    without this, a sharded job's groups outlived their destruction and their threads ran into
    interpreter finalization."""
    for comm in list(_live_groups):
        comm.group = None
    for mesh in list(_live_meshes):  # roots: a slice of one registers its groups in the root's
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


class ProcessGroupCommunicator(Communicator):
    """A torch.distributed process group (gloo on CPU, NCCL on CUDA) seen as a Communicator."""

    def __init__(
        self,
        group: Any,
        device: torch.device,
        *,
        ranks: Sequence[int] | None = None,
        probe: FailureProbe | None = None,
    ) -> None:
        self.group = group
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = list(ranks) if ranks is not None else list(range(self.world_size))
        self.probe = probe
        #: the collectives over this group, numbered (``comm.sequence``: the failure monitor
        #: tells replicas waiting in different ones apart)
        self.log = CollectiveLog()
        _live_groups.add(self)

    @classmethod
    def pending(cls, device: torch.device, *, probe: FailureProbe | None = None) -> ProcessGroupCommunicator:
        """A communicator with no group yet: a process coming back into a running job, alone until
        it is let in (``rejoin``); as one process meanwhile, so nothing waits for the others."""
        self = cls.__new__(cls)
        self.group = None
        self.device = torch.device(device)
        self.rank, self.world_size, self.global_ranks = 0, 1, [0]
        self.probe = probe
        self.log = CollectiveLog()
        _live_groups.add(self)
        return self

    def rejoin(self, group: Any) -> None:
        """Talk over ``group`` from now on (the job's new process group after a lost replica:
        every holder of this communicator follows; ranks are the new group's)."""
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = list(range(self.world_size))
        self.log.reset()  # every member numbers its collectives over the new group afresh
        # every member checks each call site again (a member new to the job has checked none)
        self.__dict__.pop("_checked_sites", None)

    @contextlib.contextmanager
    def _guard(self, op: str, what: str | None = None, seq: int | None = None) -> Iterator[None]:
        """A collective's call: its backend error explained, and (``what``: a collective every
        member makes) numbered in ``log`` and marked as waited in (``seq``: one already numbered,
        started asynchronously)."""
        try:
            with in_collective(), self._numbered(what, seq):
                yield
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, CollectiveError):
                raise
            raise classify_failure(e, self.probe, op) from e

    def _numbered(self, what: str | None, seq: int | None) -> contextlib.AbstractContextManager[None]:
        if what is None:
            return contextlib.nullcontext()
        return self.log.collective(what) if seq is None else self.log.waiting(seq, what)

    #: (on_failure="continue") a lost peer's (rank, why) once one is known, else None: the
    #: collectives that poll it give up waiting for a peer that fell silent (a host cut off,
    #: whose connections never reset) instead of waiting out the backend's timeout
    give_up_when: Callable[[], tuple[int, str] | None] | None = None

    def _wait(self, work: Any, op: str) -> None:
        """Wait for ``work``; with ``give_up_when``, poll it and leave the work behind (its group
        kept alive, see ``_abandoned``) once a peer is known lost."""
        if self.give_up_when is None:
            work.wait()
            return
        with giving_up_allowed():
            while not work.is_completed():
                lost = self.give_up_when()
                if lost is not None:
                    _abandoned.append((self.group, work))
                    raise WorkerFailedError(f"{op} failed because worker {lost[0]} failed: {lost[1]}", rank=lost[0])
                time.sleep(0.0002)
        work.wait()  # its own error, if it failed

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> None:
        with self._guard("all_reduce", describe("all_reduce", tensor)):
            if self.give_up_when is None:
                dist.all_reduce(tensor, op=_DIST_OPS[op], group=self.group)
            else:
                self._wait(dist.all_reduce(tensor, op=_DIST_OPS[op], group=self.group, async_op=True), "all_reduce")

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        what = describe("all_reduce", tensor)
        seq = self.log.start()
        with self._guard("all_reduce"):
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _GuardedWork(work, self, "all_reduce", what, seq)

    def all_gather_async(self, tensor: torch.Tensor, out: list[torch.Tensor]) -> Any:
        what = describe("all_gather", tensor)
        seq = self.log.start()
        with self._guard("all_gather"):
            work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        return _GuardedWork(work, self, "all_gather", what, seq)

    def _start_all_to_all(
        self, send: torch.Tensor, recv: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]
    ) -> Any:
        return dist.all_to_all_single(recv.view(-1), send.view(-1), list(recv_splits), list(send_splits), group=self.group,
                                      async_op=True)  # fmt: skip

    def all_to_all_async(
        self, send: torch.Tensor, recv: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]
    ) -> Any:
        what = describe("all_to_all", send, sized=False)
        seq = self.log.start()
        with self._guard("all_to_all"):
            work = self._start_all_to_all(send, recv, send_splits, recv_splits)
        return _GuardedWork(work, self, "all_to_all", what, seq)

    def all_to_all(
        self, send: torch.Tensor, recv: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]
    ) -> None:
        with self._guard("all_to_all", describe("all_to_all", send, sized=False)):
            self._wait(self._start_all_to_all(send, recv, send_splits, recv_splits), "all_to_all")

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._guard("all_gather", describe("all_gather", tensor)):
            if self.give_up_when is None:
                dist.all_gather(out, tensor.contiguous(), group=self.group)
            else:
                self._wait(dist.all_gather(out, tensor.contiguous(), group=self.group, async_op=True), "all_gather")
        return out

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        with self._guard("broadcast", describe("broadcast", tensor)):
            dist.broadcast(tensor, src=self.global_ranks[src], group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        with self._guard("all_gather_object", "all_gather_object"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src``'s object on every member (one broadcast: the others send nothing)."""
        box = [obj if self.rank == src else None]
        with self._guard("broadcast_object", "broadcast_object"):
            dist.broadcast_object_list(box, src=self.global_ranks[src], group=self.group)
        return box[0]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        with self._guard("gather_object", "gather_object"):
            dist.gather_object(obj, out, dst=self.global_ranks[dst], group=self.group)
        return out

    def barrier(self) -> None:
        with self._guard("barrier", "barrier"):
            if self.device.type == "cuda":
                dist.barrier(group=self.group, device_ids=[self.device.index or 0])
            else:
                dist.barrier(group=self.group)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        with self._guard("send"):
            dist.send(tensor.contiguous(), dst=self.global_ranks[dst], group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        with self._guard("recv"):
            dist.recv(tensor, src=self.global_ranks[src], group=self.group)

    def split(self, groups: Sequence[Sequence[int]]) -> Communicator:
        if dist.is_initialized() and self.world_size != dist.get_world_size():
            # torch's new_group is collective over every process of the job: a sub-group's
            # members alone calling it wait forever for the others
            raise ValueError(
                f"split() of a group of {self.world_size} of the job's {dist.get_world_size()} processes: "
                "torch's new_group needs every process; split the job's whole communicator"
            )
        flat = sorted(r for g in groups for r in g)
        if flat != list(range(self.world_size)):
            raise ValueError(f"groups {list(map(list, groups))} must cover ranks 0..{self.world_size - 1} once")
        mine: Communicator | None = None
        for g in groups:
            granks = [self.global_ranks[r] for r in g]
            pg = dist.new_group(ranks=granks)
            if self.rank in g:
                mine = (
                    LocalCommunicator(self.device)
                    if len(g) == 1
                    else ProcessGroupCommunicator(pg, self.device, ranks=granks, probe=self.probe)
                )
        assert mine is not None
        return mine


eager_only(ProcessGroupCommunicator, ["broadcast_object"])


class _GuardedWork:
    def __init__(self, work: Any, comm: ProcessGroupCommunicator, op: str = "all_reduce",
                 what: str | None = None, seq: int | None = None) -> None:  # fmt: skip
        self.work = work
        self.comm = comm
        self.op = op
        self.what, self.seq = what, seq

    def wait(self) -> bool:
        with self.comm._guard(self.op, self.what, self.seq):
            return bool(self.work.wait())


def before_world_group() -> None:
    """Call before the world process group is made: torch modules that bind ``group.WORLD`` into
    their functions' defaults at import are imported now, while it is None.

    ``torch.distributed.nn.functional`` does (``def broadcast(..., group=group.WORLD)``), and
    ``torch.compile`` imports it (through ``torch._dynamo``). Imported after the group exists, it
    holds the world group for the life of the process: the group outlives its destruction at exit
    and its gloo threads run into interpreter finalization, where a thread dropping a tensor
    aborts the process ("terminate called without an active exception", exit code -6, after the
    program's work is done; seen once in CI). Imported before, those defaults are None, which
    means the default group at call time: the same behaviour."""
    import torch.distributed.nn.functional  # noqa: F401


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    backend: str,
    device: torch.device,
    timeout: float,
    is_store_server: bool,
    probe: FailureProbe | None = None,
    attempt: int = 0,
) -> tuple[ProcessGroupCommunicator, Any]:
    """Meet the other ``world_size - 1`` processes; returns the communicator and the store.

    Each process first says in the store that it has come (under this ``attempt``: a launcher's
    store outlives a restart) and waits, within ``timeout``, for the others: one that never
    comes (not started, or unable to reach the store) is an error naming it, before torch's own
    rendezvous would wait it out with a key name and a C++ warning."""
    store = connect_store(master_addr, master_port, world_size, is_master=is_store_server, timeout=timeout, rank=rank)
    start = time.monotonic()
    came = f"stratagem/came/{attempt}/"
    try:
        store.set(f"{came}{rank}", "1")
        missing = await_keys(store, [f"{came}{r}" for r in range(world_size)], timeout)
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveError(
            f"rank {rank} of {world_size} lost the rendezvous store at {master_addr}:{master_port} while "
            f"waiting for the others to join ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
    if missing:
        names = ", ".join(map(str, missing))
        raise CollectiveError(
            f"rank {rank} of {world_size}: rank{'s' if len(missing) > 1 else ''} {names} never joined the job "
            f"at {master_addr}:{master_port} within {timeout:g}s (not started, or started with another "
            "cluster: check that every worker was started with the same TF_CONFIG / --nnodes and "
            "--rdzv-endpoint, and that its host can reach this address)"
        )
    delta = datetime.timedelta(seconds=max(1.0, timeout - (time.monotonic() - start)))
    before_world_group()
    try:
        # the group's own keys (gloo's addresses) under this attempt's prefix, as torch elastic
        # keys its rounds: a launcher's store outlives a restart, and an attempt that read the
        # addresses of the one before it would connect to processes that are gone
        group_store = dist.PrefixStore(f"stratagem/group/{attempt}/", store)
        dist.init_process_group(backend, store=group_store, rank=rank, world_size=world_size, timeout=delta)
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveError(
            f"rank {rank} of {world_size} could not form the process group at "
            f"{master_addr}:{master_port} ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from e
    group = dist.group.WORLD
    return ProcessGroupCommunicator(group, device, probe=probe), store


def await_keys(store: Any, keys: Sequence[str], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds until every key is set in ``store``; the indices of those
    still missing then (none: all are there). One call per look, at first every 5 ms."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while not store.check(list(keys)):
        if time.monotonic() >= deadline:
            return [i for i, k in enumerate(keys) if not store.check([k])]
        time.sleep(pause)
        pause = min(0.05, pause * 2)
    return []


def _store_error(rank: int, where: str, timeout: float, e: BaseException) -> CollectiveError:
    return CollectiveError(
        f"rank {rank} could not reach the rendezvous at {where} within {timeout:.0f}s "
        f"(phase: connect to the store; {str(e).splitlines()[0] if str(e) else type(e).__name__}); "
        "check the address, the port and that every worker was started"
    )


def connect_store(
    master_addr: str, master_port: int, world_size: int, *, is_master: bool, timeout: float, rank: int
) -> Any:
    """The job's TCPStore (hosted here when ``is_master``), within ``timeout`` whatever the peer
    at the address does.

    torch's client waits for the store's answer to its first message without a time limit: a
    process that accepts the connection and never answers (a stale listener, another service, a
    wrong address) would hold every worker forever. And while nothing accepts connections there,
    its retries outlive its own deadline (torch 2.13, timeout 5 s: it gave up after 5.7 to 13.6 s).
    So a client first waits here, within the deadline, until something accepts a connection at
    the address; then torch's client is made on a helper thread; past the deadline its connection
    is shut down (which ends the wait inside torch). The error names the address, the rank and
    the phase.
    """
    where = f"{master_addr}:{master_port}"
    delta = datetime.timedelta(seconds=timeout)
    deadline = time.monotonic() + timeout
    if not is_master and not _await_listener(master_addr, master_port, deadline):
        raise _store_error(rank, where, timeout, TimeoutError("nobody accepts connections there"))
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(
                master_addr, master_port, world_size, is_master=is_master, timeout=delta,
                wait_for_workers=False,
            )  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=connect, name="stratagem-store-connect", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0) + 2.0)
    if thread.is_alive():
        end = time.monotonic() + timeout + 5.0
        while thread.is_alive() and time.monotonic() < end:  # torch's client reconnects: again
            _shut_connections_to(master_addr, master_port)
            thread.join(0.05)
        if not _listening(master_addr, master_port):  # torch's retries outlived the deadline
            raise _store_error(rank, where, timeout, TimeoutError("nobody accepts connections there"))
        raise CollectiveError(
            f"rank {rank} reached {where}, but nothing there answered as a rendezvous store within "
            f"{timeout:.0f}s (phase: store handshake); another process holds that port (a stale "
            "job, another service) or the address is wrong: check MASTER_ADDR/MASTER_PORT, "
            "TF_CONFIG or --rdzv-endpoint"
        )
    if "error" in box:
        e = box["error"]
        if isinstance(e, (RuntimeError, dist.DistError)):
            raise _store_error(rank, where, timeout, e) from e
        raise e
    return box["store"]


def _await_listener(host: str, port: int, deadline: float) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` before ``deadline`` (tried
    again every 10 ms at first, then every 0.2 s; a host that drops the attempts silently is
    waited for only until the deadline)."""
    pause = 0.01
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if _listening(host, port, timeout=min(left, 1.0)):
            return True
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, 0.2)


def _listening(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _shut_connections_to(host: str, port: int) -> None:
    """Shut down this process's TCP connections to ``host:port`` (ends a receive blocked on them)."""
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            copy = os.dup(fd)
        except OSError:
            continue
        try:
            s = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)
            continue
        try:
            peer = s.getpeername()
            if isinstance(peer, tuple) and peer[1] == port and str(peer[0]).removeprefix("::ffff:") in addrs:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()
