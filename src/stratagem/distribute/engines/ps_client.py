"""A process's view of parameter-server variables: local tensors the model computes with,
refreshed from the ps tasks before a function runs (dense variables, read whole) or row by row
as a batch touches them (embedding tables), and the gradients pushed back after ``step()``.
Each read or write holds ``rpc_membership.LOCK`` from its calls to their answers, so that it
never overlaps a change of the rpc group's members in this process."""

from __future__ import annotations

import re
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stratagem.distribute.engines import rpc_membership
from stratagem.distribute.engines.ps_plan import VariablePlan
from stratagem.distribute.engines.ps_store import OptimizerSpec

#: the attribute a tensor backed by a ps variable carries: the client and the variable id
TAG = "_stratagem_ps_variable"


class ParameterServerError(RuntimeError):
    """A ps task could not be reached: training cannot go on without the variables it holds."""


def rebuilt_error(name: str, message: str, by: str, where: str, remote_tb: str = "") -> BaseException:
    """An exception of type ``name`` raised ``by`` something on another task (``where``), raised
    here: the built-in type of that name (RuntimeError for others), its traceback there in a note."""
    import builtins

    cls = getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls, message = RuntimeError, f"{name}: {message}"
    text = f"{message} (raised by {by})"
    try:
        err: BaseException = cls(text)
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        err = RuntimeError(f"{name}: {text}")
    if remote_tb.strip():
        err.add_note(f"traceback on {where}:\n{remote_tb.rstrip()}")
    return err


@dataclass
class _Lookup:
    ids: torch.Tensor  # the unique global rows read
    rows: torch.Tensor  # their values, a leaf that collects their gradient


@dataclass
class Binding:
    """One local tensor and the variable behind it."""

    plan: VariablePlan
    lookups: list[_Lookup] = field(default_factory=list)


def tag(t: torch.Tensor, client: VariableClient, vid: int) -> None:
    setattr(t, TAG, (client, vid))


def tagged(t: object) -> tuple[VariableClient, int] | None:
    return getattr(t, TAG, None) if isinstance(t, torch.Tensor) else None

def until_answered(fut: Any, give_up: Callable[[], BaseException | None]) -> None:
    """Wait for rpc future ``fut``, raising what ``give_up()`` returns as soon as it returns one
    (torch cannot cancel the call: it ends at its own timeout)."""
    if fut.done():
        return
    answered = threading.Event()
    fut.add_done_callback(lambda _: answered.set())
    while not answered.wait(0.05):
        error = give_up()
        if error is not None:
            raise error


class VariableClient:
    """The variables of one ParameterServerStrategy as this process sees them."""

    def __init__(self, task: str, stores: Sequence[Any], ps_names: Sequence[str], timeout: float) -> None:
        self.task = task
        self.stores = list(stores)  # each ps task's ParameterStore (ps_store.StoreHandle)
        self.ps_names = list(ps_names)
        self.timeout = timeout
        self.plans: dict[int, VariablePlan] = {}
        self.local: dict[int, torch.Tensor] = {}
        self.bindings: dict[int, Binding] = {}
        self._lock = threading.Lock()
        #: (on the chief) the error to raise now for a call to ps task ``i`` still unanswered, once
        #: its watch found that task lost (None: keep waiting): a stopped or cut-off ps task
        #: never answers, and the call's own timeout is the whole job's
        self.give_up: Callable[[int], BaseException | None] | None = None

    # --- the local tensors ------------------------------------------------------------------
    def adopt(self, plan: VariablePlan, tensor: torch.Tensor) -> None:
        """``tensor`` (the chief's own parameter) stands for ``plan``'s variable here."""
        self.plans[plan.vid] = plan
        self.local[plan.vid] = tensor
        self.bindings[plan.vid] = Binding(plan)
        tag(tensor, self, plan.vid)

    def tensor(self, plan: VariablePlan, requires_grad: bool, is_param: bool) -> torch.Tensor:
        """The local tensor of ``plan`` (made on first use: an embedding table as a zero-size
        stand-in of the full shape, since only the rows a batch touches are ever read)."""
        with self._lock:
            t = self.local.get(plan.vid)
            if t is None:
                if plan.rows:
                    data = torch.zeros((), dtype=plan.dtype).expand(plan.shape)
                else:
                    data = torch.empty(plan.shape, dtype=plan.dtype)
                t = nn.Parameter(data, requires_grad=requires_grad) if is_param else data
                self.adopt(plan, t)
            return t

    # --- reads -------------------------------------------------------------------------------
    def call(self, ps: int, method: str, *args: Any) -> Any:
        store = self.stores[ps]
        try:
            return getattr(store.rpc_async(timeout=self.timeout), method)(*args)
        except Exception as e:  # the send itself failed
            raise self.lost(ps, e) from None

    def lost(self, ps: int, e: BaseException) -> BaseException:
        """The error for a failed call to ps task ``ps``: the exception it raised, if it raised
        one (the task is alive: torch's rpc re-raises it here as "On WorkerInfo(...): ..."), else
        a ParameterServerError (the task cannot be reached: its variables are lost)."""
        text = str(e)
        if re.match(r"(\w+: )?On WorkerInfo\(", text):
            lines = text.splitlines()
            where = self.ps_names[ps]
            return rebuilt_error(
                type(e).__name__, lines[1] if len(lines) > 1 else text, f"parameter server {where}", where,
                "\n".join(lines[2:]),
            )  # fmt: skip
        return ParameterServerError(
            f"{self.task} could not reach parameter server {self.ps_names[ps]} ({type(e).__name__}: "
            f"{(str(e).splitlines()[0] if str(e) else '').split(' (this error originated')[0]}); the "
            "variables it holds are lost: restart the job and restore the last checkpoint"
        )

    def answers(self, futures: Iterable[tuple[int, Any]]) -> list[Any]:
        """The answers of calls made by :meth:`call` (the caller holds ``rpc_membership.LOCK``
        around both)."""
        out = []
        for ps, fut in futures:
            self._until_answered(ps, fut)
            try:
                out.append(fut.wait())
            except Exception as e:
                # a task the watch found lost fails its calls too (the chief ends a stopped one):
                # what the watch saw names the cause, the call's own error does not. One
                # traceback: the error names what the call raised, the rpc internals add nothing
                known = self.give_up(ps) if self.give_up is not None else None
                raise (known if known is not None else self.lost(ps, e)) from None
        return out

    def _until_answered(self, ps: int, fut: Any) -> None:
        give_up = self.give_up
        if give_up is not None:
            until_answered(fut, lambda: give_up(ps))


    def pull(self, vids: Iterable[int]) -> None:
        """Copy the current value of every dense variable in ``vids`` into its local tensor."""
        by_ps: dict[int, list[tuple[int, int, int, str]]] = defaultdict(list)
        for vid in sorted(set(vids)):
            plan = self.plans[vid]
            if plan.rows:
                continue
            for s in plan.shards:
                by_ps[s.ps].append((vid, s.start, s.stop, s.key))
        with rpc_membership.LOCK:
            futures = [(ps, self.call(ps, "get", [k for *_, k in items])) for ps, items in by_ps.items()]
            results = self.answers(futures)
        with torch.no_grad():
            for (_, items), values in zip(by_ps.items(), results):
                for (vid, start, stop, _), value in zip(items, values):
                    local = self.local[vid]
                    if len(self.plans[vid].shards) == 1:
                        local.copy_(value)
                    else:
                        local[start:stop].copy_(value)

    def read_rows(self, vid: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (sorted, unique) of row variable ``vid``, fetched from the shards holding them."""
        plan = self.plans[vid]
        starts = torch.tensor([s.start for s in plan.shards])
        which = torch.searchsorted(starts, ids, right=True) - 1
        futures, order = [], []
        with rpc_membership.LOCK:
            for i, s in enumerate(plan.shards):
                mask = which == i
                if bool(mask.any()):
                    futures.append((s.ps, self.call(s.ps, "rows", [(s.key, ids[mask] - s.start)])))
                    order.append(mask)
            values = self.answers(futures)
        out = torch.empty((ids.numel(), *plan.shape[1:]), dtype=plan.dtype)
        for mask, value in zip(order, values):
            out[mask] = value[0]
        return out

    # --- writes ------------------------------------------------------------------------------
    def push_values(self, vids: Iterable[int]) -> None:
        """Write the local values of ``vids`` to the ps tasks (a checkpoint restored, a buffer
        a forward pass changed)."""
        by_ps: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
        for vid in vids:
            plan, local = self.plans[vid], self.local[vid].detach()
            for s in plan.shards:
                by_ps[s.ps][s.key] = local if len(plan.shards) == 1 else local[s.start : s.stop]
        with rpc_membership.LOCK:
            self.answers([(ps, self.call(ps, "put", values)) for ps, values in by_ps.items()])

    def push_gradients(self, opt_key: str, spec: OptimizerSpec, params: Iterable[torch.Tensor]) -> None:
        """One optimizer step on the ps tasks: dense gradients whole, embedding gradients as the
        rows the batch touched."""
        dense: dict[int, list[tuple[str, torch.Tensor]]] = defaultdict(list)
        sparse: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for p in params:
            info = tagged(p)
            if info is None or info[0] is not self:
                continue
            vid = info[1]
            plan, binding = self.plans[vid], self.bindings[vid]
            if plan.rows:
                grads = [(lk.ids, lk.rows.grad) for lk in binding.lookups if lk.rows.grad is not None]
                binding.lookups.clear()
                if not grads:
                    continue
                ids = torch.cat([g[0] for g in grads])
                rows = torch.cat([g[1] for g in grads])
                starts = torch.tensor([s.start for s in plan.shards])
                which = torch.searchsorted(starts, ids, right=True) - 1
                for i, s in enumerate(plan.shards):
                    mask = which == i
                    if bool(mask.any()):
                        sparse[s.ps].append((s.key, ids[mask] - s.start, rows[mask]))
                continue
            if p.grad is None:
                continue
            g = p.grad.detach()
            if g.is_sparse:
                g = g.to_dense()
            for s in plan.shards:
                dense[s.ps].append((s.key, g if len(plan.shards) == 1 else g[s.start : s.stop]))
        targets = sorted(set(dense) | set(sparse))
        with rpc_membership.LOCK:
            results = self.answers([(ps, self.call(ps, "apply", opt_key, spec, dense[ps], sparse[ps])) for ps in targets])
        for ps, failed in zip(targets, results):
            if failed is not None:  # the optimizer raised on the ps task (which is fine)
                name, message, remote_tb = failed
                where = self.ps_names[ps]
                raise rebuilt_error(name, message, f"the optimizer on parameter server {where}", where, remote_tb)

    def forget_lookups(self) -> None:
        for b in self.bindings.values():
            b.lookups.clear()


# --- embedding tables: read the touched rows only ---------------------------------------------
def embedding_rows_hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    """Forward hook of an ``nn.Embedding`` whose table lives on ps tasks: the output recomputed
    from the rows this batch touches, read from their shards, as a leaf that collects their
    gradient (pushed as rows by the optimizer's ``step``)."""
    info = tagged(module.weight)
    if info is None:
        return output
    client, vid = info
    ids = args[0]
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    rows = client.read_rows(vid, unique.reshape(-1).to(torch.long))
    pad = None
    padding_idx = getattr(module, "padding_idx", None)
    if padding_idx is not None:
        hit = (unique == padding_idx).nonzero()
        pad = int(hit[0, 0]) if hit.numel() else None
    if torch.is_grad_enabled() and module.weight.requires_grad:
        rows.requires_grad_(True)
        client.bindings[vid].lookups.append(_Lookup(unique.reshape(-1), rows))
    return F.embedding(
        inverse, rows, pad, None, 2.0, bool(getattr(module, "scale_grad_by_freq", False)), False
    )
