"""Strategy, the user-facing API, and StrategyExtended, the small interface strategies implement.

As in tf.distribute, ``Strategy`` is the same for every strategy and delegates to its
``extended`` object, which is where strategies differ (data-parallel replicas, pipeline stages).
Concrete strategies are final subclasses that only build their ``extended``.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stratagem.comm import Communicator
from stratagem.core.batches import place
from stratagem.core.eager import eager_frames, eager_only
from stratagem.distribute import context
from stratagem.distribute.mixed_precision import Policy, RunOptions
from stratagem.distribute.reduce_op import ReduceOp


class Execution(enum.Enum):
    """How ``strategy.run`` executes a step: one answer per strategy, where training code used to
    ask a flag per capability (``is_pipeline``, ``coordinates_workers``, ``global_program``)."""

    #: each replica computes its share of the global batch, all in step (Mirrored, MultiWorker,
    #: Sharded, ModelParallel, the default strategy)
    REPLICAS = "replicas"
    #: one program over the global batch for all replicas (SPMD: TPUStrategy); values inside are global
    GLOBAL = "global"
    #: the model runs as stages over micro-batches (PipelineStrategy)
    PIPELINE = "pipeline"
    #: steps are functions a coordinator schedules onto workers, each stepping on its own
    #: (ParameterServerStrategy)
    COORDINATED = "coordinated"


class StateLayout(enum.Enum):
    """Where a model's state lives across the job's processes, and so how a checkpoint is written
    (``train/checkpoint/manager.py`` maps each to its writer)."""

    #: one state, the same on every process: the chief writes whole files
    MIRRORED = "mirrored"
    #: every process holds different state (pipeline stages): each part's writer writes whole files
    PER_RANK = "per_rank"
    #: parameters and optimizer state split across processes (DTensors): every process writes its
    #: own shards with torch.distributed.checkpoint
    SHARDED = "sharded"


class StrategyExtended(abc.ABC):
    """What a strategy must provide; ``Strategy`` turns it into tf.distribute's API."""

    _owner: weakref.ref[Strategy] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "call_for_replica" in cls.__dict__:
            # under stratagem.function: run's machinery stays eager, the step it runs compiles
            # (one graph per step function, not one per function run happened to be given)
            eager_frames(cls, ["call_for_replica"])

    def bind(self, strategy: Strategy) -> None:
        """Called once by the Strategy this object extends."""
        self._owner = weakref.ref(strategy)

    def owner(self) -> Strategy:
        s = self._owner() if self._owner is not None else None
        if s is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to a live Strategy")
        return s

    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int: ...

    @property
    @abc.abstractmethod
    def replica_id(self) -> int:
        """This process's replica id in the sync group."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device | None:
        """Where this process's replica computes (None: leave tensors where they are)."""

    @property
    @abc.abstractmethod
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoint files (every process holding state no other
        writer has: the chief of a data-parallel job, copy 0 of each pipeline stage)."""

    @property
    def should_log(self) -> bool:
        """Whether this process prints progress and writes logs (exactly one process of the job)."""
        return self.world.rank == 0

    @property
    @abc.abstractmethod
    def world(self) -> Communicator:
        """Every process of the job (collective decisions, checkpoints)."""

    @property
    def execution(self) -> Execution:
        """How ``run`` executes a step (each replica its share, one global program, stages over
        micro-batches, or functions scheduled onto workers): what fit and the loss helpers ask."""
        return Execution.REPLICAS

    @property
    def state_layout(self) -> StateLayout:
        """Where the model's state lives across processes: what a checkpoint writes."""
        return StateLayout.MIRRORED

    @property
    def requires_scope(self) -> bool:
        """Whether modules must be created in ``scope()`` to be used with this strategy."""
        return False

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` stepping the parameters this strategy placed: a sharding strategy builds
        the model on meta in its scope and replaces the parameters an optimizer made there
        holds. Done before a first step anyway; a checkpoint asks for it before reading state."""
        return optimizer

    def checkpoint_saved(self, path: str) -> None:
        """A CheckpointManager wrote ``path`` (a strategy whose failures need a checkpoint to
        resume from names it in the error)."""
        return None

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Inside: backward passes accumulate gradients locally, not reduced (see Strategy.no_sync)."""
        return contextlib.nullcontext()

    def merge_values(self, value: Any) -> list[Any]:
        """Every replica's ``value`` (objects), in replica order (called by every replica)."""
        return [value]

    def local_results(self, value: Any) -> tuple[Any, ...]:
        """The parts of a per-replica ``value`` that tf's process for this strategy would hold:
        this process's value where one process is one replica of its worker (MultiWorker, one
        device), every local replica's, gathered, where tf runs them all in one process
        (MirroredStrategy; then every replica must call it)."""
        return (value,)

    @abc.abstractmethod
    def scope(self) -> contextlib.AbstractContextManager[None]:
        """Capture what is created inside ``strategy.scope()`` (modules, optimizers)."""

    @abc.abstractmethod
    def call_for_replica(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Run ``fn`` as this process's replica(s); return its local result."""

    @abc.abstractmethod
    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        """``value`` reduced across the replicas in sync (called by every replica)."""

    @abc.abstractmethod
    def reduce(self, op: ReduceOp, value: Any, axis: int | None) -> Any: ...

    @abc.abstractmethod
    def gather(self, value: Any, axis: int) -> Any: ...

    @abc.abstractmethod
    def distribute_dataset(self, dataset: Iterable[Any], options: Any) -> Iterable[Any]: ...

    @abc.abstractmethod
    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any) -> Iterable[Any]: ...

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait for every process of the strategy."""


class ReplicaContext:
    """What a replica sees inside ``strategy.run``: its id, the replica count, all_reduce."""

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int) -> None:
        self.strategy = strategy
        self.replica_id_in_sync_group = replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """``value`` reduced across replicas; every replica must pass the same structure/shapes."""
        return self.strategy.extended.all_reduce(ReduceOp.of(reduce_op), value)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Every replica's ``value`` concatenated along ``axis`` in replica order (tf's
        ``ReplicaContext.all_gather``; sizes along ``axis`` may differ)."""
        return self.strategy.extended.gather(value, axis)

    def merge_call(self, merge_fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` once with all replicas' values (tf's
        ``merge_call``): each positional and keyword argument becomes a :class:`PerReplica`
        holding every replica's value, in replica order, and ``merge_fn`` runs in a
        cross-replica context. stratagem runs one replica per process, so every process runs
        ``merge_fn`` on the same values and gets the same result (it must be deterministic)."""
        everyone = self.strategy.extended.merge_values((tuple(args), dict(kwargs or {})))
        per_args = tuple(PerReplica(tuple(e[0][i] for e in everyone)) for i in range(len(args)))
        per_kwargs = {k: PerReplica(tuple(e[1][k] for e in everyone)) for k in (kwargs or {})}
        with context.cross_replica(self.strategy):
            return merge_fn(self.strategy, *per_args, **per_kwargs)

    def __repr__(self) -> str:
        return f"ReplicaContext(replica {self.replica_id_in_sync_group} of {self.num_replicas_in_sync})"


class PerReplica:
    """Every replica's value of something, in replica order (what ``merge_call`` hands over).
    ``strategy.experimental_local_results(v)`` and ``v.values`` give the tuple. Printed as
    tf.distribute prints one: ``PerReplica:{\n  0: ...,\n  1: ...\n}``."""

    def __init__(self, values: tuple[Any, ...]) -> None:
        self.values = tuple(values)

    def _show(self, part: Callable[[Any], str]) -> str:
        body = ",\n".join(f"  {i}: {part(v)}" for i, v in enumerate(self.values))
        return f"{type(self).__name__}:{{\n{body}\n}}"

    def __str__(self) -> str:
        return self._show(str)

    def __repr__(self) -> str:
        return self._show(repr)


# Tensors ``Strategy.reduce`` / ``gather`` returned: one value for the whole job (a plain tensor
# in tf), so ``experimental_local_results`` of one is ``(value,)``, not a copy per replica. Held
# by identity and weakly (tensors compare by value).
_cross_replica: dict[int, weakref.ref[torch.Tensor]] = {}


def _mark_cross_replica(value: Any) -> Any:
    for t in _tensor_leaves(value):
        key = id(t)

        def forget(_ref: object, key: int = key) -> None:
            _cross_replica.pop(key, None)

        _cross_replica[key] = weakref.ref(t, forget)
    return value


def _is_cross_replica(value: Any) -> bool:
    leaves = _tensor_leaves(value)
    return bool(leaves) and all((r := _cross_replica.get(id(t))) is not None and r() is t for t in leaves)


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensor_leaves(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensor_leaves(v)]
    return []


def live_strategies() -> list[Strategy]:
    """The strategies this process made that are still alive, oldest first (``sg.is_chief()``
    asks them, as a script makes its strategy once and uses it outside any scope)."""
    return list(_made)


_made: weakref.WeakSet[Strategy] = weakref.WeakSet()


@dataclass(frozen=True)
class ValueContext:
    """What ``value_fn`` is told by ``experimental_distribute_values_from_function``."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


def _check_run_arguments(fn: Any, args: Any, kwargs: Any) -> None:
    """``run``'s arguments as tf.distribute takes them: a callable, a sequence, a mapping (a
    tensor passed as ``args`` would otherwise be unpacked row by row into ``fn``)."""
    if not callable(fn):
        raise TypeError(f"strategy.run(fn, ...): fn must be callable, got {type(fn).__name__}")
    if isinstance(args, (str, bytes, Mapping)) or hasattr(args, "shape") or not hasattr(args, "__iter__"):
        hint = " (write args=(x,) for one argument)" if hasattr(args, "shape") else ""
        raise TypeError(f"strategy.run(fn, args=...): args must be a tuple or list of fn's positional "
                        f"arguments, got {type(args).__name__}{hint}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"strategy.run(fn, kwargs=...): kwargs must be a dict of keyword arguments, "
                        f"got {type(kwargs).__name__}")


def _check_axis(what: str, value: Any, axis: int | None) -> None:
    """An axis the (tensor) value has, named in the error instead of torch's IndexError."""
    if axis is None or not isinstance(value, torch.Tensor):
        return
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"strategy.{what}(..., axis=...): axis must be an int or None, got {type(axis).__name__}")
    n = value.dim()
    if not -max(n, 1) <= axis < max(n, 1):
        raise ValueError(f"strategy.{what}(..., axis={axis}): the value has {n} dimension"
                         f"{'' if n == 1 else 's'} (shape {list(value.shape)}); axis must be in "
                         f"[{-max(n, 1)}, {max(n, 1) - 1}]")


class Strategy:
    """Distribution of one training program over replicas (tf.distribute.Strategy's API)."""

    def __init__(self, extended: StrategyExtended) -> None:
        self._extended = extended
        extended.bind(self)
        _made.add(self)

    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each step."""
        return self._extended.num_replicas_in_sync

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Make this the current strategy; modules and optimizers created here are distributed."""
        with context.strategy_scope(self), self._extended.scope():
            yield

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` on every replica; returns this process's per-replica value.

        ``options=RunOptions(precision="bf16")`` runs ``fn`` under autocast on the replica's device."""
        _check_run_arguments(fn, args, kwargs)
        if options is not None and options.precision is not None:
            policy = Policy.of(options.precision)
            if policy.name != "32":
                inner, device = fn, self._extended.device

                def fn(*a: Any, **k: Any) -> Any:
                    with policy.autocast(device):
                        return inner(*a, **k)

        return self._extended.call_for_replica(fn, tuple(args), dict(kwargs or {}))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combine per-replica ``value`` across replicas (and along ``axis`` if given).

        With ``axis=None`` replicas' values are added (SUM) or averaged (MEAN) element-wise; with
        an axis the values are also reduced along it, and MEAN divides by the true number of
        elements along that axis over all replicas. The result is the same on every replica.
        """
        op = ReduceOp.of(reduce_op)
        _check_axis("reduce", value, axis)
        return _mark_cross_replica(self._extended.reduce(op, value, axis))

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate per-replica ``value`` along ``axis`` in replica order (sizes may differ)."""
        _check_axis("gather", value, axis)
        return _mark_cross_replica(self._extended.gather(value, axis))

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> Iterable[Any]:
        """Global batches in, this replica's slice of each out (zero-size when it gets none)."""
        if not hasattr(dataset, "__iter__"):
            raise TypeError(
                "experimental_distribute_dataset takes an iterable of global batches (a stratagem "
                f"Dataset, a DataLoader, a list of batches); got {type(dataset).__name__}"
            )
        return self._extended.distribute_dataset(dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any = None
    ) -> Iterable[Any]:
        """Per-replica batches from ``dataset_fn(InputContext)``, called once per input pipeline."""
        if not callable(dataset_fn):
            raise TypeError(
                "distribute_datasets_from_function takes a function of an InputContext that "
                f"returns this pipeline's dataset; got {type(dataset_fn).__name__}, which is not callable"
            )
        return self._extended.distribute_datasets_from_function(dataset_fn, options)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The parts of ``value`` tf's process would hold, in replica order, as a tuple.

        stratagem runs one process per replica, so what ``strategy.run`` returns (and each batch
        of a distributed dataset) is this replica's part only. Under ``MirroredStrategy``, where
        tf's one process holds every replica of the machine, the parts of every local replica
        are gathered, so a loop written for tf (the distributed-input tutorial collecting
        predictions) sees all of them: **every replica must make the call**, as every replica
        runs the same program (inside ``if strategy.is_chief:`` it waits for the others until
        the collective times out). Other replicas' tensors arrive on this replica's device.
        Under ``MultiWorkerMirroredStrategy`` (one replica per process on each worker, as
        tf's worker holds its own replicas only) and one-process strategies it is ``(value,)``.

        A :class:`PerReplica` (``merge_call``) gives its values; a result of ``strategy.reduce``
        or ``strategy.gather`` (one value for the job, a plain tensor in tf) gives
        ``(value,)``. Any other value is taken as per-replica; a plain constant made outside
        ``run`` gives one copy per local replica where tf gives one."""
        if isinstance(value, PerReplica):
            return value.values
        if _is_cross_replica(value):
            return (value,)
        return self._extended.local_results(value)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """This replica's value ``value_fn(ValueContext(replica_id, num_replicas))`` (placed on its
        device), as tf's function of the same name gives each replica its own value."""
        ext = self._extended
        value = value_fn(ValueContext(ext.replica_id, ext.num_replicas_in_sync))
        return place(value, ext.device)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside do not reduce them; the first
        backward pass after it reduces everything accumulated, once (DDP's ``no_sync``). Use it
        for the first k-1 micro-batches of a gradient-accumulation step, inside ``run``."""
        with self._extended.no_sync():
            yield

    def barrier(self) -> None:
        """Wait until every process of the strategy gets here."""
        self._extended.barrier()

    @property
    def is_chief(self) -> bool:
        """Whether this process is the job's chief: the one process that prints, logs and
        writes (rank 0; the coordinator under ParameterServerStrategy). stratagem runs the
        script once per replica, so code that must happen once asks this first."""
        return bool(self._extended.should_log)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The chief runs the block first while the other processes wait; then they run it
        (Accelerate's ``main_process_first``): download or preprocess a dataset once, into a
        cache the others then read. Every process must enter it. If the block raises on the
        chief, the chief's error ends it and the others' wait ends with a WorkerFailedError
        (or a CollectiveTimeoutError), never a silent start without the chief's work."""
        chief = self.is_chief
        if not chief:
            self._extended.barrier()
        yield
        if chief:
            self._extended.barrier()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"


# under stratagem.function: run's own frame is eager (the step it calls compiles on its own),
# reductions and gathers are collectives and run eagerly with everything they call
eager_frames(Strategy, ["run"])
eager_only(Strategy, ["reduce", "gather"])
