"""ParameterServerExtended: variables on ps tasks, functions run on workers (torch.distributed.rpc).

Every task runs the same script. The chief (the coordinator) creates the model and optimizer in
``strategy.scope()``; when the scope closes their parameters and buffers are placed on the ps
tasks (``ps_plan``) and the chief's tensors stand for them. Worker and ps tasks serve from the
strategy's constructor until the chief is done, then leave (``serve``). A function scheduled by
the ClusterCoordinator travels pickled by value with handles for what a worker has its own of
(``ps_pickle``); on the worker its dense variables are read, it runs as the worker's one replica,
and its optimizer's ``step()`` sends the gradients to the ps tasks, which apply them
(``ps_store``), embedding tables row by row (``ps_client``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import signal
import sys
import threading
import traceback
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.cluster.ps_spec import EXIT_CHIEF_LOST, PSClusterSpec
from stratagem.comm import Communicator, LocalCommunicator, interfaces
from stratagem.comm.communicator import await_keys
from stratagem.comm.failure import FailureOptions
from stratagem.distribute import ownership
from stratagem.distribute.engines import rpc_membership
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.engines.ps_client import (
    ParameterServerError,
    VariableClient,
    embedding_rows_hook,
    tagged,
    until_answered,
)
from stratagem.distribute.engines.ps_pickle import dumps, loads
from stratagem.distribute.engines.ps_plan import Partitioner, VariablePlan, plan_variables
from stratagem.distribute.engines.ps_store import (
    OptimizerSpec,
    class_payload,
    importable,
    open_store,
)
from stratagem.distribute.engines.ps_watch import ClusterWatch, Loss
from stratagem.distribute.reduce_op import ReduceOp
from stratagem.distribute.strategy import Execution, StrategyExtended

#: the runtime each worker process serves (one ParameterServerStrategy per process), found by
#: the functions the coordinator calls over rpc
_RUNTIMES: dict[str, WorkerRuntime] = {}


def _rpc() -> Any:
    import torch.distributed.rpc as rpc

    return rpc


#: the chief's store keys under which the tasks leave together at the end
LEAVE_PREFIX = "stratagem/leave"


def rpc_name(task_type: str, index: int) -> str:
    return "chief" if task_type == "chief" else f"{task_type}:{index}"


class WorkerOptimizer:
    """A worker's stand-in for the chief's optimizer: the same parameter groups over the worker's
    tensors; ``step()`` sends their gradients to the ps tasks, which step the real optimizer."""

    def __init__(self, client: VariableClient, key: str, groups: list[tuple[OptimizerSpec, list[torch.Tensor]]]) -> None:
        self._client = client
        self._key = key
        self._groups = groups
        self.param_groups = [dict(spec[2], params=params) for spec, params in groups]
        self.state: dict[Any, Any] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, params in self._groups:
            for p in params:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for (spec, params), group in zip(self._groups, self.param_groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            self._client.push_gradients(self._key, (spec[0], spec[1], hyper), params)
        return loss


def optimizer_spec(opt: torch.optim.Optimizer) -> list[tuple[OptimizerSpec, list[int]]]:
    """Each parameter group of ``opt``: how to rebuild it on a ps task, and its variables."""
    cls = type(opt)
    # a class made at run time (sg.optimizers' Keras optimizers) travels by value
    plain = importable(cls)
    payload = b"" if plain else class_payload(opt)
    out: list[tuple[OptimizerSpec, list[int]]] = []
    for group in opt.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params" and not isinstance(v, torch.Tensor)}
        vids = []
        for p in group["params"]:
            info = tagged(p)
            if info is None:
                raise ValueError(
                    f"{cls.__name__} steps a parameter of shape {tuple(p.shape)} that was not created in "
                    "`with strategy.scope():` of this ParameterServerStrategy; create the model and the "
                    "optimizer inside the scope so their variables live on the ps tasks"
                )
            vids.append(info[1])
        out.append(((cls.__module__, cls.__qualname__, hyper) if plain else ("", payload, hyper), vids))
    return out


class WorkerRuntime:
    """What a worker task keeps between functions: the variable client, optimizer stand-ins,
    per-worker datasets and their iterators."""

    def __init__(self, task: str, strategy_ref: Callable[[], Any]) -> None:
        self.task = task
        self.strategy_ref = strategy_ref
        self.client: VariableClient | None = None
        self.optimizers: dict[str, WorkerOptimizer] = {}
        self.datasets: dict[str, Any] = {}
        self.iterators: dict[str, Iterator[Any]] = {}
        self.metrics: dict[int, tuple[Any, torch.Tensor]] = {}  # this function's: copy, totals before
        self.stopped = threading.Event()
        self.busy = threading.Lock()

    def configure(self, stores: list[Any], ps_names: list[str], plans: list[VariablePlan], timeout: float) -> None:
        if self.client is None:
            self.client = VariableClient(self.task, stores, ps_names, timeout)
        for plan in plans:
            self.client.plans[plan.vid] = plan

    def resolve(self, handle: tuple[Any, ...], touched: set[int]) -> Any:
        kind = handle[0]
        client = self.client
        if kind == "var":
            _, vid, is_param, requires_grad = handle
            assert client is not None, "functions reach a worker only after the variables are placed"
            touched.add(vid)
            return client.tensor(client.plans[vid], requires_grad, is_param)
        if kind == "opt":
            _, key, groups = handle
            assert client is not None
            opt = self.optimizers.get(key)
            if opt is None or [s for s, _ in opt._groups] != [s for s, _ in groups]:
                tensors = [(spec, [client.tensor(client.plans[v], True, True) for v in vids]) for spec, vids in groups]
                opt = WorkerOptimizer(client, key, tensors)
                self.optimizers[key] = opt
            else:
                for group, (spec, _) in zip(opt.param_groups, groups):
                    group.update(spec[2])  # hyperparameters as the chief has them now
            return opt
        if kind == "strategy":
            return self.strategy_ref()
        if kind == "metric":
            _, index, blob = handle
            if index not in self.metrics:
                metric = loads(blob, lambda h: self.resolve(h, touched))
                self.metrics[index] = (metric, metric.local_totals())
            return self.metrics[index][0]
        if kind == "iterator":
            _, key, dataset_key, fn_bytes = handle
            it = self.iterators.get(key)
            if it is None:
                dataset = self.datasets.get(dataset_key)
                if dataset is None:
                    if fn_bytes is None:
                        raise RuntimeError(f"{self.task} has no per-worker dataset {dataset_key}")
                    dataset = _call_dataset_fn(loads(fn_bytes, lambda h: self.resolve(h, touched)), self)
                    self.datasets[dataset_key] = dataset
                it = iter(dataset)
                self.iterators[key] = it
            return it
        if kind == "dataset":
            _, dataset_key, fn_bytes = handle
            dataset = self.datasets.get(dataset_key)
            if dataset is None:
                dataset = _call_dataset_fn(loads(fn_bytes, lambda h: self.resolve(h, touched)), self)
                self.datasets[dataset_key] = dataset
            return dataset
        raise ValueError(f"unknown handle {handle!r}")

    def run(self, payload: bytes) -> tuple[Any, ...]:
        """Run one scheduled function: ("ok", value, metric updates) or ("error", (type name,
        message, traceback)). The metric updates are ``(index, totals added)`` for each metric
        the function captured and updated (``handle_of``)."""
        with self.busy:
            touched: set[int] = set()
            self.metrics = {}
            try:
                fn, args, kwargs = loads(payload, lambda h: self.resolve(h, touched))
                if self.client is not None:
                    self.client.forget_lookups()
                    self.client.pull(touched)
                    before = self._buffer_versions(touched)
                strategy = self.strategy_ref()
                with strategy.scope():
                    value = fn(*args, **kwargs)
                if self.client is not None:
                    changed = [v for v, ver in before.items() if self.client.local[v]._version != ver]
                    if changed:
                        self.client.push_values(changed)
                added = [(i, m.local_totals() - before) for i, (m, before) in sorted(self.metrics.items())]
                return ("ok", _detach(value), [(i, t) for i, t in added if bool(t.any())])
            except StopIteration as e:
                return ("error", ("StopIteration", str(e) or "the per-worker iterator is exhausted", ""))
            except BaseException as e:  # delivered to the coordinator, which raises it there
                return ("error", (type(e).__name__, str(e), traceback.format_exc()))
            finally:
                self.metrics = {}

    def _buffer_versions(self, vids: Iterable[int]) -> dict[int, int]:
        assert self.client is not None
        return {
            v: self.client.local[v]._version
            for v in vids
            if v in self.client.local and not isinstance(self.client.local[v], nn.Parameter)
        }


def _call_dataset_fn(fn: Callable[..., Any], runtime: WorkerRuntime) -> Any:
    import inspect

    from stratagem.distribute.engines.input import InputContext

    strategy = runtime.strategy_ref()
    index = int(runtime.task.split(":")[1])
    try:
        takes = len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):
        takes = False
    if not takes:
        return fn()
    ext = strategy.extended
    return fn(InputContext(ext.num_workers, index, 1))


def accumulates(o: Any) -> bool:
    """Whether ``o`` is a streaming metric (``stratagem.metrics.Metric``'s protocol: its state is
    totals that add, ``local_totals()`` / ``add_totals(t)``): a scheduled function's updates of
    one are sent back and added to the chief's (tf keeps a metric made in ``scope()`` in
    variables on the ps tasks, which every worker's update adds to)."""
    cls = type(o)
    return callable(getattr(cls, "local_totals", None)) and callable(getattr(cls, "add_totals", None))


def _no_handles(o: Any) -> None:
    return None


def _detach(value: Any) -> Any:
    from stratagem.core import tree

    return tree.map_structure(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)


# --- functions the coordinator calls on a worker ----------------------------------------------
def _configure(task: str, stores: list[Any], ps_names: list[str], plans: list[VariablePlan], timeout: float) -> None:
    _RUNTIMES[task].configure(stores, ps_names, plans, timeout)


def _run_closure(task: str, payload: bytes) -> tuple[Any, ...]:
    runtime = _RUNTIMES.get(task)
    if runtime is None or runtime.stopped.is_set():
        return ("gone", f"{task} is leaving the cluster")
    return runtime.run(payload)


def _stop(task: str) -> None:
    runtime = _RUNTIMES.get(task)
    if runtime is not None:
        runtime.client = None  # its references to the ps tasks' stores go before rpc shuts down
        runtime.optimizers.clear()
        runtime.stopped.set()


class TaskLostError(RuntimeError):
    """A task the cluster watch found lost (its process gone or stopped, or silent)."""


class ParameterServerExtended(StrategyExtended):
    """The engine of ParameterServerStrategy (one replica per worker, variables on ps tasks)."""

    def __init__(self, spec: PSClusterSpec, partitioner: Partitioner | None, timeout: float,
                 failure: FailureOptions | None = None) -> None:
        self.spec = spec
        self.partitioner = partitioner
        self.timeout = timeout
        if failure is not None and not failure.enabled:
            raise ValueError(
                "ParameterServerStrategy: FailureOptions(enabled=False) is not supported: the chief "
                "must watch its workers and ps tasks to go on without a lost worker; set "
                "dead_after_seconds (and heartbeat_seconds) to change how fast a task is declared lost"
            )
        #: how fast a silent task is declared lost (None: ps_watch's defaults)
        self.failure = failure
        self._local = DataParallelExtended(LocalCommunicator("cpu"), torch.device("cpu"), mirror=False, name="ParameterServerStrategy")
        self.num_workers = spec.num_workers
        self.num_ps = spec.num_ps
        self.ps_names = [rpc_name("ps", i) for i in range(spec.num_ps)]
        self.worker_names = [rpc_name("worker", i) for i in range(spec.num_workers)]
        self.plans: list[VariablePlan] = []
        self.stores: list[Any] = []
        self.client: VariableClient | None = None
        self._pending: list[tuple[nn.Module, str, torch.Tensor, bool]] = []
        self._closed = False
        self.lost_tasks: list[str] = []  # workers the coordinator found unreachable
        self._optimizer_keys: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.coordinator: Any = None  # the strategy's ClusterCoordinator (one per strategy, as tf)
        self.dataset_keys = itertools.count()  # per-worker datasets, numbered per strategy
        self.functions_done = 0  # functions workers ran (the chief's copies are stale after one)
        self._pulled_at = 0
        self.last_checkpoint: str | None = None  # what a lost ps task's error names to resume from
        self._store: Any = None
        self._nonce = uuid.uuid4().hex  # this process, among the restarts of its task
        self._admitted: set[str] = set()  # the rejoin requests the chief answered
        #: how often each worker is restarted when it fails (`stratagem run --max-restarts`, or a
        #: cluster manager saying so in STRATAGEM_WORKER_RESTARTS): the chief then waits for a
        #: restarted worker when every worker is lost, instead of failing at once
        self.worker_restarts = int(os.environ.get("STRATAGEM_WORKER_RESTARTS", "0") or 0)
        #: the tasks this task's watch found lost (rpc name -> what was observed), this process of each
        self.failed: dict[str, str] = {}
        #: the error that ends training (a ps task lost), once known
        self.fatal: BaseException | None = None
        self._watch: ClusterWatch | None = None
        self._chief_lost: str | None = None  # a task: why it leaves (the chief is gone or failed)
        self._ended_by_error = False  # the chief's program raised: its tasks were told, no graceful leave
        self._abandoned: list[Any] = []  # calls to lost workers given up on (still pending in torch)

    def bind(self, strategy: Any) -> None:
        super().bind(strategy)
        self._local.bind(strategy)  # a worker's one replica runs as the strategy's

    # --- the rpc world --------------------------------------------------------------------
    def join(self) -> None:
        """Meet the cluster in the chief's store, then join its rpc group: a dynamic group, so a
        worker that died can come back (``_ask_to_rejoin``, ``readmit``). Called once bound to
        its strategy: the chief may schedule a function onto a worker as soon as it is in the
        group, and the function runs in the strategy's scope."""
        self.owner()  # bound first (a function arriving before ``bind`` found no strategy)
        s = self.spec
        rejoining = False
        store = self._meet()
        self._store = store  # the chief's TCPStore, shared with rpc's rendezvous (multi-tenant)
        self._start_watch()  # from here this process is watched, and watches (before a rejoin: its new pid)
        rank = s.rank
        if s.task_type == "worker" and store.check([f"stratagem/joined/{s.rpc_name}"]):
            rank, rejoining = self._ask_to_rejoin(store), True  # this worker ran before and died
        if s.task_type == "worker":
            _RUNTIMES[s.rpc_name] = WorkerRuntime(s.rpc_name, lambda: self.owner())
        own = {"chief": s.chief, "worker": s.workers, "ps": s.ps}[s.task_type]
        own = own if isinstance(own, str) else own[s.task_id]
        # across machines, rpc (TensorPipe) and gloo talk on the interface holding this task's
        # address (left alone they advertise what the hostname resolves to: loopback on Debian)
        interfaces.pin(interfaces.host_part(own), s.master_addr, s.master_port, rank=s.rank,
                       variables=(interfaces.TENSORPIPE, interfaces.GLOO))
        try:
            rpc_membership.join(s.rpc_name, rank, f"tcp://{s.master_addr}:{s.master_port}", self.timeout)
        except Exception as e:
            raise RuntimeError(
                f"ParameterServerStrategy: {s.rpc_name} could not meet the cluster (chief {s.chief}, "
                f"{s.num_workers} workers, {s.num_ps} ps) within {self.timeout:g}s ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}): start every task listed in TF_CONFIG, "
                "or use `stratagem run --workers N --ps P script.py`"
            ) from e
        store.set(f"stratagem/joined/{s.rpc_name}", self._nonce)
        if not rejoining:
            try:
                self._await_group(store)
            except Exception as e:
                if s.is_chief:
                    raise
                # in the group, this task may have run the chief's functions already, and the
                # chief may be done with them (and gone) before every task was here
                first = str(e).splitlines()[0] if str(e) else ""
                self._leave_without_chief(self._chief_lost or f"is lost (its store at {s.master_addr}:"
                                          f"{s.master_port} cannot be reached ({type(e).__name__}: {first}))")
        if s.is_chief:
            for i, name in enumerate(self.ps_names):
                try:
                    self.stores.append(open_store(name, self.timeout))
                except Exception as e:
                    raise ParameterServerError(
                        f"parameter server {name} ({s.ps[i]}) is unreachable ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}): "
                        "check that its task runs and its address in TF_CONFIG"
                    ) from e
            self.client = VariableClient("chief", self.stores, self.ps_names, self.timeout)
            self.client.give_up = lambda ps: self.fatal  # a lost ps task: every read and write fails now
            _install_step_guard()
            import atexit

            atexit.register(self.shutdown)

    # --- who is still there (ps_watch) ------------------------------------------------------
    def _start_watch(self) -> None:
        s = self.spec
        bounds = {} if self.failure is None else {
            "silent_after": self.failure.dead_after_seconds, "beat": self.failure.heartbeat_seconds}
        self._watch = ClusterWatch(
            s.master_addr, s.master_port, s.rpc_name, self._watched, self._on_loss, nonce=self._nonce, **bounds,
        ).start()
        if s.is_chief:
            previous = sys.excepthook

            def excepthook(*exc: Any) -> None:
                self._ended_by_error = True  # the tasks are told at once (they leave), then the traceback
                if self._watch is not None:
                    first = str(exc[1]).splitlines()[0] if str(exc[1]) else ""
                    first = first if len(first) <= 300 else first[:300].rsplit(" ", 1)[0] + " ..."
                    self._watch.end(f"failed ({exc[0].__name__}: {first})" if first else f"failed ({exc[0].__name__})")
                previous(*exc)

            sys.excepthook = excepthook

    def _watched(self) -> list[str]:
        if not self.spec.is_chief:
            return ["chief"]
        return [n for n in [*self.worker_names, *self.ps_names] if n not in self.lost_tasks and n not in self.failed]

    def _on_loss(self, loss: Loss) -> None:
        """What the watch found (on its thread): the chief goes on without a lost worker, and
        ends training on a lost ps task; a task leaves when the chief is lost."""
        if not self.spec.is_chief:  # the chief's own record says "failed (...)"
            self._chief_lost = loss.why if loss.why.startswith("failed (") else f"is lost ({loss.why})"
            return
        if self._closed:
            return
        self.failed[loss.task] = loss.why
        if loss.task in self.ps_names:
            address = self.spec.ps[self.ps_names.index(loss.task)]
            last = self.last_checkpoint
            self.fatal = ParameterServerError(
                f"parameter server {loss.task} ({address}) failed: {loss.why}; the variables it holds are "
                f"lost: restart the job and restore the last checkpoint "
                f"({f'the last checkpoint this job saved: {last}' if last else 'this job saved no checkpoint'})"
            )
        # only now (the error that names the loss is in place: a call the kill fails must raise
        # it, not the bare "eof" of a closed connection) is a stopped process on this host ended
        if loss.stopped_pid is not None:
            with contextlib.suppress(OSError):
                os.kill(loss.stopped_pid, signal.SIGKILL)
        if self.coordinator is not None:
            self.coordinator.task_lost(loss.task)

    def _await_group(self, store: Any) -> None:
        """Wait (bounded) until every task of the cluster is in the rpc group."""
        self._await_tasks(
            store, "joined",
            lambda missing: f"{', '.join(missing)} did not join the rpc group within {self.timeout:g}s: "
            "check that every task listed in TF_CONFIG runs",
        )  # fmt: skip

    def _await_tasks(self, store: Any, key: str, says: Callable[[list[str]], str]) -> None:
        """Wait until every task has set ``stratagem/{key}/{task}`` in the chief's store; after
        the timeout, a RuntimeError saying ``says(missing tasks)``."""
        names = self.spec.rpc_names
        missing = await_keys(store, [f"stratagem/{key}/{n}" for n in names], self.timeout)
        if missing:
            raise RuntimeError(f"ParameterServerStrategy: {says([names[i] for i in missing])}")

    def _ask_to_rejoin(self, store: Any) -> int:
        """A restarted worker asks the chief to take it back; the chief answers with a new rank
        once the dead process is out of the group. Leaves (exit 0) if no answer comes."""
        from datetime import timedelta

        name = self.spec.rpc_name
        store.set(f"stratagem/rejoin/{name}", self._nonce)
        key = f"stratagem/admit/{name}/{self._nonce}"
        try:
            store.wait([key], timedelta(seconds=self.timeout))
            return int(store.get(key).decode())
        except Exception as e:
            sys.stderr.write(
                f"stratagem: {name} restarted, but the chief did not take it back within {self.timeout:g}s "
                f"({type(e).__name__}; training may be over); leaving\n"
            )
            sys.stderr.flush()
            os._exit(0)

    # --- the chief: workers that die and come back ---------------------------------------------
    def rejoin_request(self, worker: str) -> str | None:
        """The id of a restarted ``worker``'s request to come back, if one waits."""
        key = f"stratagem/rejoin/{worker}"
        try:
            if not self._store.check([key]):
                return None
            nonce = self._store.get(key).decode()
        except Exception:
            return None
        return None if nonce in self._admitted else str(nonce)

    def evict(self, worker: str) -> None:
        """A dead worker leaves the rpc group (what its own shutdown would have done)."""
        if worker not in self.lost_tasks:
            self.lost_tasks.append(worker)
        live = [n for n in [*self.worker_names, *self.ps_names] if n not in self.lost_tasks and n not in self.failed]

        def gone(task: str) -> bool:  # found lost meanwhile, or training is over (a ps task lost)
            return task in self.failed or self.fatal is not None

        with contextlib.suppress(Exception):  # a ps that cannot be told is lost: its error comes on its own
            rpc_membership.evict(worker, live, timeout=min(self.timeout, 10.0), gone=gone)

    def readmit(self, worker: str, nonce: str) -> bool:
        """Take the restarted ``worker`` back under a new rank; whether it joined in time. Its
        ``init_rpc`` adds it to every member's agent: the caller has made the cluster quiet, and
        the chief's own calls wait (``rpc_membership.LOCK``) until it has joined."""
        import time

        def joined() -> bool:  # it says so once init_rpc has told every member
            with contextlib.suppress(Exception):
                return bool(self._store.get(f"stratagem/joined/{worker}").decode() == nonce)
            return False

        with rpc_membership.LOCK:
            self._admitted.add(nonce)
            rank = self.spec.world_size + len(self._admitted) - 1  # never used before
            self._store.set(f"stratagem/admit/{worker}/{nonce}", str(rank))
            deadline = time.monotonic() + self.timeout
            while not joined() and time.monotonic() < deadline:
                time.sleep(0.05)
            # the agent's table is read only now that nothing changes it
            back = joined() and rpc_membership.members().get(worker) == rank
        if back:
            self.failed.pop(worker, None)  # a new process: watched again
            if worker in self.lost_tasks:
                self.lost_tasks.remove(worker)
        return back

    def _meet(self) -> Any:
        """Every task says it is here in the chief's store (torch's TCPStore at the chief's
        address, which rpc's rendezvous then shares): the chief names the tasks that did not
        come, a task names the chief it cannot reach, each within the timeout."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        s = self.spec
        try:
            store = TCPStore(
                s.master_addr, s.master_port, is_master=s.is_chief, timeout=timedelta(seconds=self.timeout),
                multi_tenant=True, wait_for_workers=False,
            )  # fmt: skip
        except Exception as e:
            raise RuntimeError(
                f"ParameterServerStrategy: {s.rpc_name} could not reach the chief at {s.chief} within "
                f"{self.timeout:g}s ({type(e).__name__}): start the chief task, or check its address in TF_CONFIG"
            ) from e
        store.set(f"stratagem/present/{s.rpc_name}", "1")
        if s.is_chief:
            addresses = dict(zip(s.rpc_names, [s.chief, *s.workers, *s.ps]))
            self._await_tasks(
                store, "present",
                lambda missing: f"{', '.join(f'{n} ({addresses[n]})' for n in missing)} did not join the "
                f"cluster within {self.timeout:g}s: start every task listed in TF_CONFIG "
                "(or use `stratagem run --workers N --ps P script.py`)",
            )  # fmt: skip
        return store

    def serve(self) -> None:
        """A worker or ps task: answer the chief until it is done (or lost), then leave. The
        chief is watched through its TCPStore (``ps_watch``), not over rpc: an rpc call in flight
        while a member joins or is taken out can crash this process (``rpc_membership``)."""
        name = self.spec.rpc_name
        runtime = _RUNTIMES.get(name)
        if runtime is None:
            runtime = _RUNTIMES[name] = WorkerRuntime(name, lambda: self.owner())
        while not runtime.stopped.wait(0.05):
            if self._chief_lost is not None:
                self._leave_without_chief(self._chief_lost)
        if self._watch is not None:
            self._watch.close()  # told to stop: the chief ending is no news now
        _RUNTIMES.pop(name, None)
        gc.collect()
        rpc_membership.leave_together(
            self._store, LEAVE_PREFIX, timeout=min(self.timeout, 10.0), owner=self.spec.task_type == "ps"
        )
        sys.exit(0)

    def _leave_without_chief(self, why: str) -> None:
        """A worker or ps task whose chief is lost or failed: say so in one line and end (exit
        code ``EXIT_CHIEF_LOST``); nobody is left to leave the rpc group with."""
        sys.stderr.write(f"stratagem: {self.spec.rpc_name}: the chief {why}; leaving\n")
        sys.stderr.flush()
        if self._watch is not None:
            self._watch.close(wait=0)  # its store may not answer (the chief's host cut off): leave now
        _shutdown_rpc_within(_rpc(), 2.0)
        os._exit(EXIT_CHIEF_LOST)

    def shutdown(self) -> None:
        """The chief is done: tell every task to leave (each answers once it has stopped taking
        work: the barrier), then leave too; bounded, skipping the tasks that were lost."""
        if self._closed:
            return
        if self.coordinator is not None:
            self.coordinator.close()
        self._closed = True
        rpc = _rpc()
        if self._watch is not None:
            self._watch.close()
        if self._ended_by_error:  # the tasks were told and are leaving: nobody to leave with
            _shutdown_rpc_within(rpc, 2.0)
            # the program raised and its traceback is out: end now (exit code 1). Tearing the
            # interpreter down with torch's rpc in it took 0.8 s more (of 1.1 s, on a loaded
            # machine), past the 2 s in which every task of a failed job ends; the exit
            # functions registered after the strategy was made have run (atexit is LIFO)
            import logging

            with contextlib.suppress(Exception):
                logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(1)
        leaving = 1  # the tasks that answered leave together with the chief
        with rpc_membership.LOCK:  # after a rejoin under way, if any
            lost = set(self.lost_tasks)
            self.stores.clear()
            if self.client is not None:
                self.client.stores = []
            gc.collect()
            futs = []
            for name in [*self.worker_names, *self.ps_names]:
                if name not in lost:
                    with contextlib.suppress(Exception):
                        futs.append(rpc.rpc_async(name, _stop, args=(name,), timeout=10))
            for f in futs:
                with contextlib.suppress(Exception):
                    f.wait()
                    leaving += 1
        with contextlib.suppress(Exception):
            self._store.set(f"{LEAVE_PREFIX}/count", str(leaving))
        # a call given up on (its worker was lost, unreachable) would hold torch's wait for this
        # process's calls until its own timeout: the others have answered, so do not wait
        pending = any(not f.done() for f in self._abandoned)
        rpc_membership.leave_together(
            self._store, LEAVE_PREFIX, timeout=min(self.timeout, 10.0), wait_for_calls=not pending
        )

    # --- variables --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _capture(self) -> Iterator[None]:
        from torch.nn.modules import module as module_mod

        def on_param(module: nn.Module, name: str, param: Any) -> None:
            if param is not None:
                self._pending.append((module, name, param, True))

        def on_buffer(module: nn.Module, name: str, buffer: Any) -> None:
            if buffer is not None:
                self._pending.append((module, name, buffer, False))

        h1 = module_mod.register_module_parameter_registration_hook(on_param)
        h2 = module_mod.register_module_buffer_registration_hook(on_buffer)
        try:
            yield
        finally:
            h1.remove()
            h2.remove()

    def _place(self) -> None:
        """Put what the scope created on the ps tasks; the chief's tensors stand for them."""
        assert self.client is not None
        seen: set[int] = set()
        found: list[tuple[nn.Module, str, torch.Tensor, bool]] = []
        for module, name, t, is_param in self._pending:
            current = module._parameters.get(name) if is_param else module._buffers.get(name)
            if current is not t or id(t) in seen or tagged(t) is not None:
                continue
            seen.add(id(t))
            found.append((module, name, t, is_param))
        self._pending.clear()
        if not found:
            return
        for module, name, _, _ in found:
            if isinstance(module, nn.Embedding) and name == "weight" and module.max_norm is not None:
                raise ValueError(
                    f"nn.Embedding(max_norm={module.max_norm}) renormalizes rows in place; under "
                    "ParameterServerStrategy its table lives on the ps tasks: use max_norm=None"
                )
        first = len(self.plans)
        specs = [
            (f"{type(m).__name__}.{n}", tuple(t.shape), t.dtype, isinstance(m, nn.Embedding) and n == "weight")
            for m, n, t, _ in found
        ]
        placed = sum(len(p.shards) for p in self.plans)
        new = plan_variables(specs, self.num_ps, self.partitioner, first, placed)
        self.plans.extend(new)
        owned: dict[int, tuple[nn.Module, list[int]]] = {}
        strategy = self.owner()
        for plan, (module, _, t, _) in zip(new, found):
            self.client.adopt(plan, t)
            ownership.claim(t, strategy)
            if plan.rows:
                module.register_forward_hook(embedding_rows_hook)
            owned.setdefault(id(module), (module, []))[1].append(plan.vid)
        for module, vids in owned.values():
            # a forward pass on the chief computes with the variables' current values
            module.register_forward_pre_hook(_ChiefRead(self))
            # state_dict() reads the variables from the ps tasks; load_state_dict() writes them there
            module.register_state_dict_pre_hook(_ChiefSync(self, vids, pull=True))
            module.register_load_state_dict_post_hook(_ChiefSync(self, vids, pull=False))
        self.client.push_values(p.vid for p in new)
        self._configured: set[str] = set()

    # --- what the coordinator uses -----------------------------------------------------------
    def handle_of(
        self,
        registry: Any,
        worker: str,
        optimizers: list[torch.optim.Optimizer] | None = None,
        metrics: list[Any] | None = None,
    ) -> Callable[[Any], tuple[Any, ...] | None]:
        """How objects are written when a function is shipped to ``worker`` (the optimizers it
        uses are added to ``optimizers``; with ``metrics``, the metrics it captures are added
        there and travel as handles: the worker updates a copy and sends back what it added,
        which the coordinator adds to the chief's metric)."""
        strategy = self.owner()

        def handle(o: Any) -> tuple[Any, ...] | None:
            if metrics is not None and accumulates(o):
                for i, m in enumerate(metrics):
                    if m is o:
                        return ("metric", i, None)  # the worker has it from the first mention
                metrics.append(o)
                return ("metric", len(metrics) - 1, dumps(o, _no_handles))
            if isinstance(o, torch.Tensor):
                info = tagged(o)
                if info is not None and info[0] is self.client:
                    return ("var", info[1], isinstance(o, nn.Parameter), o.requires_grad)
                return None
            if o is strategy:
                return ("strategy",)
            if isinstance(o, torch.optim.Optimizer):
                if optimizers is not None:
                    optimizers.append(o)
                return ("opt", self.prepare_optimizer_key(o), optimizer_spec(o))
            return registry.handle(o, worker)

        return handle

    @staticmethod
    def stepped(optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """A worker ran a function with these optimizers: mark them stepped as torch's LR
        schedulers track it (their wrapper of ``step`` sets this flag), since the chief's own
        ``step`` never runs; a scheduler on the chief then does not warn that it stepped first."""
        for opt in optimizers:
            if hasattr(opt.step, "_wrapped_by_lr_sched"):
                opt._opt_called = True  # type: ignore[attr-defined]

    def checkpoint_saved(self, path: str) -> None:
        self.last_checkpoint = path

    def prepare_optimizer_key(self, opt: torch.optim.Optimizer) -> str:
        """The key of ``opt``'s state on the ps tasks; its state_dict() reads that state there and
        its load_state_dict() writes it there (checkpoints, portable to the other strategies)."""
        key = self._optimizer_keys.get(opt)
        if key is None:
            key = f"o{len(self._optimizer_keys)}"
            self._optimizer_keys[opt] = key
            opt.register_state_dict_post_hook(_OptimizerSync(self, key, read=True))
            opt.register_load_state_dict_post_hook(_OptimizerSync(self, key, read=False))
        return key

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.spec.is_chief and any(tagged(p) is not None for g in optimizer.param_groups for p in g["params"]):
            self.prepare_optimizer_key(optimizer)
        return optimizer

    def optimizer_state(self, opt: torch.optim.Optimizer, key: str, sd: dict[str, Any]) -> dict[str, Any]:
        """``sd`` (the chief's ``opt.state_dict()``) with the state the ps tasks hold."""
        assert self.client is not None
        index = 0
        state: dict[int, Any] = {}
        for group in opt.param_groups:
            for p in group["params"]:
                info = tagged(p)
                if info is not None:
                    plan = self.plans[info[1]]
                    with rpc_membership.LOCK:  # a lost ps task fails the save within seconds
                        futures = [(sh.ps, self.client.call(sh.ps, "optimizer_state", key, [sh.key])) for sh in plan.shards]
                        parts = [answer[0] for answer in self.client.answers(futures)]
                    merged = _merge_shard_states(parts, plan)
                    if merged:
                        state[index] = merged
                index += 1
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_optimizer_state(self, opt: torch.optim.Optimizer, key: str) -> None:
        """Write ``opt``'s state (just loaded on the chief) to the ps tasks."""
        assert self.client is not None
        groups = optimizer_spec(opt)
        for (spec, vids), group in zip(groups, opt.param_groups):
            for vid, p in zip(vids, group["params"]):
                st = opt.state.get(p)
                if not st:
                    continue
                plan = self.plans[vid]
                for sh in plan.shards:
                    part = {
                        k: (v[sh.start : sh.stop] if isinstance(v, torch.Tensor) and v.dim() > 0
                            and len(plan.shards) > 1 and v.shape[0] == plan.shape[0] else v)
                        for k, v in st.items()
                    }  # fmt: skip
                    with rpc_membership.LOCK:
                        fut = self.client.call(sh.ps, "load_optimizer_state", key, spec, {sh.key: part})
                        self.client.answers([(sh.ps, fut)])
        opt.state.clear()  # the ps tasks hold it; the chief's optimizer never steps

    def configure_worker(self, worker: str) -> None:
        rpc = _rpc()
        rpc.rpc_sync(worker, _configure, args=(worker, self.stores, self.ps_names, self.plans, self.timeout), timeout=self.timeout)

    def run_on(self, worker: str, payload: bytes, timeout: float) -> tuple[Any, ...]:
        """Run a scheduled function on ``worker``; raises TaskLostError as soon as the watch finds
        the worker lost, and the fatal error once training cannot go on (not after ``timeout``)."""
        rpc = _rpc()
        fut = rpc.rpc_async(worker, _run_closure, args=(worker, payload), timeout=timeout)

        def give_up() -> BaseException | None:
            if self.fatal is None and worker not in self.failed:
                return None
            self._abandoned.append(fut)  # torch cannot cancel it: it ends at its timeout
            return self.fatal if self.fatal is not None else TaskLostError(self.failed[worker])

        until_answered(fut, give_up)
        try:
            return fut.wait()  # type: ignore[no-any-return]
        except Exception:  # ended with the task the watch found lost: say what it saw
            known = give_up()
            if known is None:
                raise
            raise known from None

    def traffic(self) -> list[tuple[int, int]]:
        """Bytes each ps task received and sent."""
        with rpc_membership.LOCK:
            return [store.rpc_sync(timeout=self.timeout).traffic() for store in self.stores]

    def refresh(self) -> None:
        """The chief's copies read anew if a worker ran a function since they were last read."""
        done = self.functions_done
        if done != self._pulled_at:
            self.pull_all()
            self._pulled_at = done

    def pull_all(self, vids: Sequence[int] | None = None) -> None:
        """The chief's tensors set to the variables' current values (embedding tables whole)."""
        if self.client is None or not self.plans:
            return
        plans = self.plans if vids is None else [self.plans[v] for v in vids]
        self.client.pull(p.vid for p in plans)
        client = self.client
        shards = [(plan, s) for plan in plans if plan.rows for s in plan.shards]
        with rpc_membership.LOCK, torch.no_grad():
            values = client.answers([(s.ps, client.call(s.ps, "get", [s.key])) for _, s in shards])
            for (plan, s), value in zip(shards, values):
                client.local[plan.vid][s.start : s.stop].copy_(value[0])

    def push_all(self, vids: Sequence[int] | None = None) -> None:
        """The chief's tensors written to the ps tasks (a restored checkpoint)."""
        if self.client is not None and self.plans:
            self.client.push_values(p.vid for p in self.plans if vids is None or p.vid in vids)

    # --- StrategyExtended --------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @property
    def replica_id(self) -> int:
        return 0

    @property
    def device(self) -> torch.device | None:
        return torch.device("cpu")

    @property
    def should_checkpoint(self) -> bool:
        return self.spec.is_chief

    @property
    def world(self) -> Communicator:
        return self._local.world

    @property
    def requires_scope(self) -> bool:
        return True

    @property
    def execution(self) -> Execution:
        return Execution.COORDINATED

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        if not self.spec.is_chief:
            yield
            return
        with self._capture():
            yield
        self._place()

    def call_for_replica(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if self.spec.is_chief:
            self.pull_all()  # inline evaluation on the coordinator reads the current values
        return self._local.call_for_replica(fn, args, kwargs)

    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        return self._local.all_reduce(op, value)

    def reduce(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        return self._local.reduce(op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        return self._local.gather(value, axis)

    def distribute_dataset(self, dataset: Iterable[Any], options: Any) -> Iterable[Any]:
        return self._local.distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any) -> Iterable[Any]:
        return self._local.distribute_datasets_from_function(dataset_fn, options)

    def barrier(self) -> None:
        return None


class _ChiefSync:
    """A module hook on the chief: ``state_dict()`` first reads the module's variables from the ps
    tasks (``pull``), ``load_state_dict()`` then writes them there. A module shipped to a worker
    takes it along as a hook that does nothing."""

    def __init__(self, ext: ParameterServerExtended, vids: list[int], pull: bool) -> None:
        self.ext = weakref.ref(ext)
        self.vids = vids
        self.pull = pull

    def __call__(self, *args: Any) -> None:
        ext = self.ext()
        if ext is None or ext._closed:
            return
        (ext.pull_all if self.pull else ext.push_all)(self.vids)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Inert, ())


class _ChiefRead:
    """A forward pre-hook on the chief: after workers ran functions, the first forward pass reads
    every variable's current value from the ps tasks (tf reads them on the coordinator too).
    Shipped to a worker, it does nothing."""

    def __init__(self, ext: ParameterServerExtended) -> None:
        self.ext = weakref.ref(ext)

    def __call__(self, *args: Any) -> None:
        ext = self.ext()
        if ext is not None and not ext._closed:
            ext.refresh()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Inert, ())


class _OptimizerSync:
    """An optimizer hook on the chief: its state lives on the ps tasks."""

    def __init__(self, ext: ParameterServerExtended, key: str, read: bool) -> None:
        self.ext = weakref.ref(ext)
        self.key = key
        self.read = read

    def __call__(self, opt: torch.optim.Optimizer, sd: Any = None) -> Any:
        ext = self.ext()
        if ext is None or ext._closed:
            return sd
        if self.read:
            return ext.optimizer_state(opt, self.key, sd)
        ext.load_optimizer_state(opt, self.key)
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Inert, ())


def _merge_shard_states(parts: list[dict[str, Any]], plan: VariablePlan) -> dict[str, Any]:
    """One variable's optimizer state from its shards' (tensors of the shard's rows joined; the
    rest, as ``step``, from the first shard that has state). A shard never updated has none: its
    rows' state is zeros, as a fresh optimizer's."""
    have = [p for p in parts if p]
    if not have:
        return {}
    if len(parts) == 1:
        return parts[0]
    template = have[0]
    out: dict[str, Any] = {}
    for k, v in template.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            rows = []
            for sh, part in zip(plan.shards, parts):
                rows.append(part[k] if part else torch.zeros((sh.stop - sh.start, *v.shape[1:]), dtype=v.dtype))
            out[k] = torch.cat(rows)
        else:
            out[k] = v
    return out


class _Inert:
    def __call__(self, *args: Any) -> None:
        return None


# --- the chief's own optimizers stepping ps variables: only through the coordinator -------------
_GUARD: list[Any] = []


def _step_guard(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            if tagged(p) is not None:
                raise RuntimeError(
                    f"{type(opt).__name__}.step() on the coordinator: under ParameterServerStrategy the "
                    "variables live on the ps tasks and are updated by the functions workers run; "
                    "schedule the training step with coordinator.schedule(step_fn, args=...)"
                )


def _shutdown_rpc_within(rpc: Any, seconds: float) -> None:
    """torch's ungraceful rpc shutdown, given at most ``seconds`` (the process ends next): with
    calls still out to peers whose host is cut off, it may wait for their timeouts."""
    def run() -> None:
        with contextlib.suppress(Exception):
            rpc.shutdown(graceful=False)

    t = threading.Thread(target=run, name="stratagem-rpc-shutdown", daemon=True)
    t.start()
    t.join(seconds)


def _install_step_guard() -> None:
    if not _GUARD:
        from torch.optim import optimizer as optim_mod

        _GUARD.append(optim_mod.register_optimizer_step_pre_hook(_step_guard))

