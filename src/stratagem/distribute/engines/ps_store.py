"""What one ps task holds: variable shards, their optimizers (made on the first update, from the
class and hyperparameters the worker's optimizer has), and the reads and updates workers call
over torch.distributed.rpc. One lock per shard: updates from different workers interleave
(asynchronous training) but never tear a shard."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from typing import Any

import torch

#: how an optimizer is rebuilt on a ps task: (module, qualname, hyperparameters of its group);
#: a class a ps task cannot import by name (one made at run time, as ``sg.optimizers``' Keras
#: classes are) travels as ``("", payload, hyper)``, the payload the class itself (pickled by
#: value), its ``defaults`` and the instance's own attributes (``class_payload``)
OptimizerSpec = tuple[str, str | bytes, dict[str, Any]]

#: attributes every torch optimizer has (not sent: the ps task makes its own), and those an LR
#: scheduler on the coordinator adds (its wrapper of ``step``)
_TORCH_FIELDS = frozenset(vars(torch.optim.SGD([torch.zeros(1)], lr=0.1))) | {"step", "_opt_called"}


def importable(cls: type) -> bool:
    """Whether a ps task finds ``cls`` by its module and qualname."""
    try:
        return _optimizer_class(cls.__module__, cls.__qualname__) is cls
    except (ImportError, AttributeError):
        return False


def class_payload(opt: torch.optim.Optimizer) -> bytes:
    """``opt``'s class (by value), defaults and own attributes (e.g. a Keras optimizer's
    learning-rate schedule and epsilon), for a ps task to make the same optimizer."""
    from stratagem.distribute.engines.ps_pickle import dumps

    extras = {k: v for k, v in vars(opt).items() if k not in _TORCH_FIELDS}
    return dumps((type(opt), dict(opt.defaults), extras), lambda o: None)


def _from_payload(payload: bytes, param: torch.Tensor) -> torch.optim.Optimizer:
    """The optimizer ``class_payload`` describes, over ``param``: made as torch's ``__init__``
    makes any optimizer (its class's constructor may take what only the coordinator had), then
    given the coordinator's attributes."""
    import pickle

    cls, defaults, extras = pickle.loads(payload)
    opt = cls.__new__(cls)
    torch.optim.Optimizer.__init__(opt, [param], defaults)
    opt.__dict__.update(extras)
    return opt  # type: ignore[no-any-return]


def _optimizer_class(module: str, qualname: str) -> type[torch.optim.Optimizer]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


class ParameterStore:
    """The shards on this ps task, by key (``"vid/shard"``)."""

    def __init__(self, task: str) -> None:
        self.task = task
        self._values: dict[str, torch.Tensor] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._optimizers: dict[tuple[str, str], torch.optim.Optimizer] = {}
        #: the hyperparameters last pushed for each optimizer: only what the coordinator changed
        #: since is set again (a counter the optimizer keeps in its group, as Keras's
        #: ``iterations``, goes on here)
        self._pushed: dict[tuple[str, str], dict[str, Any]] = {}
        self._guard = threading.Lock()
        self.bytes_in = 0
        self.bytes_out = 0

    # --- placement and whole values (the chief: creation, checkpoints) ----------------------
    def put(self, values: dict[str, torch.Tensor]) -> None:
        """Create or overwrite shards (the chief, when the scope closes or a checkpoint loads)."""
        with self._guard:
            for key, value in values.items():
                lock = self._locks.setdefault(key, threading.Lock())
                with lock:
                    held = self._values.get(key)
                    if held is not None and held.shape == value.shape:
                        with torch.no_grad():
                            held.copy_(value)  # an optimizer may hold this tensor
                    else:
                        self._values[key] = value.detach().clone()

    def get(self, keys: Sequence[str]) -> list[torch.Tensor]:
        out = []
        for key in keys:
            with self._locks[key]:
                out.append(self._values[key].detach().clone())
        self.bytes_out += sum(t.numel() * t.element_size() for t in out)
        return out

    def rows(self, requests: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The rows ``index`` (shard-local) of each shard ``key``: an embedding lookup reads only
        the rows its batch touches."""
        out = []
        for key, index in requests:
            with self._locks[key]:
                out.append(self._values[key].detach().index_select(0, index))
        self.bytes_in += sum(i.numel() * i.element_size() for _, i in requests)
        self.bytes_out += sum(t.numel() * t.element_size() for t in out)
        return out

    # --- updates ------------------------------------------------------------------------------
    def apply(
        self,
        opt_key: str,
        spec: OptimizerSpec,
        dense: Sequence[tuple[str, torch.Tensor]],
        sparse: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
    ) -> tuple[str, str, str] | None:
        """One optimizer step of the worker's optimizer ``opt_key`` on the shards it updates:
        ``dense`` (key, gradient) and ``sparse`` (key, shard-local rows, their gradient rows),
        the latter as a sparse gradient (torch's optimizers that take one: SGD, Adagrad,
        SparseAdam), so untouched rows and their optimizer state stay as they are. Returns None,
        or (type name, message, traceback) of what the optimizer raised: returned, not raised,
        since torch's rpc prints every exception a remote function raises."""
        try:
            for key, grad in dense:
                self.bytes_in += grad.numel() * grad.element_size()
                self._step(opt_key, spec, key, grad)
            for key, index, rows in sparse:
                self.bytes_in += rows.numel() * rows.element_size() + index.numel() * index.element_size()
                shape = self._values[key].shape
                grad = torch.sparse_coo_tensor(index.unsqueeze(0), rows, shape, check_invariants=False).coalesce()
                self._step(opt_key, spec, key, grad)
        except Exception as e:  # noqa: BLE001 - the caller raises it
            import traceback

            return (type(e).__name__, str(e), traceback.format_exc())
        return None

    def _step(self, opt_key: str, spec: OptimizerSpec, key: str, grad: torch.Tensor) -> None:
        with self._locks[key]:
            opt = self._optimizer(opt_key, spec, key)
            last = self._pushed[(opt_key, key)]
            # a schedule on the coordinator may change them
            changed = {k: v for k, v in spec[2].items() if k not in last or not _same(last[k], v)}
            opt.param_groups[0].update(changed)
            last.update(changed)
            param = opt.param_groups[0]["params"][0]
            param.grad = grad.to(param.dtype)
            with torch.sparse.check_sparse_tensor_invariants(enable=False):  # said, not implied: no warning
                opt.step()
            param.grad = None

    def _optimizer(self, opt_key: str, spec: OptimizerSpec, key: str) -> torch.optim.Optimizer:
        """The optimizer of shard ``key`` for the worker optimizer ``opt_key`` (made on first use;
        the caller holds the shard's lock)."""
        opt = self._optimizers.get((opt_key, key))
        if opt is None:
            module, qualname, hyper = spec
            param = torch.nn.Parameter(self._values[key], requires_grad=True)
            self._values[key] = param
            if isinstance(qualname, bytes):
                opt = _from_payload(qualname, param)
            else:
                cls = _optimizer_class(module, qualname)
                # what the constructor takes; the rest (an LR scheduler's initial_lr, keys a user
                # added to the group) is set on the group as the coordinator has it
                opt = cls([param], **_constructor_kwargs(cls, hyper))
            opt.param_groups[0].update(hyper)
            self._optimizers[(opt_key, key)] = opt
            self._pushed[(opt_key, key)] = dict(hyper)
        return opt

    # --- optimizer state (checkpoints) ------------------------------------------------------
    def optimizer_state(self, opt_key: str, keys: Sequence[str]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for key in keys:
            opt = self._optimizers.get((opt_key, key))
            if opt is None:
                out.append({})
                continue
            with self._locks[key]:
                state = opt.state[opt.param_groups[0]["params"][0]]
                out.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
        return out

    def load_optimizer_state(self, opt_key: str, spec: OptimizerSpec, states: dict[str, dict[str, Any]]) -> None:
        for key, state in states.items():
            with self._locks[key]:
                opt = self._optimizer(opt_key, spec, key)
                param = opt.param_groups[0]["params"][0]
                opt.state[param] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}

    def traffic(self) -> tuple[int, int]:
        """Bytes received and sent by this task's reads and updates so far."""
        return self.bytes_in, self.bytes_out

    def ping(self) -> str:
        return self.task


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare: taken as changed
        return False


def _constructor_kwargs(cls: type, hyper: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters an optimizer class's constructor takes (all, if it takes **kwargs)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(hyper)
    names = {p.name for p in params}
    return {k: v for k, v in hyper.items() if k in names}


# --- reaching a ps task's store by name -------------------------------------------------------
#: the ParameterStore of this process, by task name (a ps task holds one; made by the chief's call)
_HERE: dict[str, ParameterStore] = {}


def _open(task: str) -> str:
    """(On a ps task.) Make its ParameterStore, once; what ``ping`` answers."""
    return _HERE.setdefault(task, ParameterStore(task)).ping()


def _call(task: str, method: str, args: tuple[Any, ...]) -> Any:
    """(On a ps task.) One call to its ParameterStore."""
    return getattr(_HERE[task], method)(*args)


class StoreHandle:
    """A ps task's ParameterStore, reached by the task's name: ``handle.rpc_sync(timeout=t).get(keys)``
    and ``handle.rpc_async(timeout=t).apply(...)`` as on torch's RRef proxies, but plain rpc calls.
    No RRef is made or shared: torch's RRef protocol sends its fork, accept and delete messages
    with retries, and the agent's retry thread holds the destination's WorkerInfo by reference;
    one pending to a worker that died, once the worker was taken out of the group, crashed the ps
    task (a segfault in ``RpcAgent::retryExpiredRpcs``, formatting ``findWorkerURL``'s error).
    Picklable (a name): the chief hands the handles to every worker."""

    def __init__(self, task: str) -> None:
        self.task = task

    def rpc_sync(self, timeout: float) -> _Calls:
        return _Calls(self.task, timeout, sync=True)

    def rpc_async(self, timeout: float) -> _Calls:
        return _Calls(self.task, timeout, sync=False)

    def __repr__(self) -> str:
        return f"StoreHandle({self.task!r})"


class _Calls:
    def __init__(self, task: str, timeout: float, sync: bool) -> None:
        self.task, self.timeout, self.sync = task, timeout, sync

    def __getattr__(self, method: str) -> Any:
        import torch.distributed.rpc as rpc

        call = rpc.rpc_sync if self.sync else rpc.rpc_async

        def invoke(*args: Any) -> Any:
            return call(self.task, _call, args=(self.task, method, args), timeout=self.timeout)

        return invoke


def open_store(task: str, timeout: float) -> StoreHandle:
    """(On the chief.) Make ps task ``task``'s ParameterStore there; its handle."""
    import torch.distributed.rpc as rpc

    rpc.rpc_sync(task, _open, args=(task,), timeout=timeout)
    return StoreHandle(task)
