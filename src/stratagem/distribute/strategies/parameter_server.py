"""ParameterServerStrategy: variables on ps tasks, steps scheduled onto workers by a coordinator."""

from __future__ import annotations

from typing import Any, final

from stratagem.cluster.resolvers import TFConfigClusterResolver
from stratagem.comm.failure import FailureOptions
from stratagem.distribute.engines.parameter_server import ParameterServerExtended
from stratagem.distribute.strategy import Strategy


@final
class ParameterServerStrategy(Strategy):
    """tf.distribute.ParameterServerStrategy on torch.distributed.rpc.

    ``cluster_resolver`` describes a cluster with a chief, workers and ps tasks (TF_CONFIG; by
    default read from the environment, as ``stratagem run --workers N --ps P`` sets it). Every
    task runs the same script: on worker and ps tasks the constructor serves the chief and ends
    the process when the chief is done; on the chief it returns, and the model and optimizer
    made in ``scope()`` live on the ps tasks (split by ``variable_partitioner``, e.g.
    ``stratagem.partitioners.FixedShardsPartitioner(2)``). Train with
    ``stratagem.coordinator.ClusterCoordinator(strategy).schedule(step_fn, args=...)``.
    ``timeout`` bounds meeting the cluster and every call between tasks (seconds). ``failure``
    (``stratagem.FailureOptions``) sets how fast a task on another host that falls silent is
    declared lost: after ``dead_after_seconds`` of silence, with a heartbeat every
    ``heartbeat_seconds`` (without ``failure``: 6 s and 0.25 s); give every task the same.
    """

    def __init__(self, cluster_resolver: Any = None, variable_partitioner: Any = None, *, timeout: float = 120.0,
                 failure: FailureOptions | None = None) -> None:
        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        ps_cluster = getattr(resolver, "ps_cluster", None)
        if ps_cluster is None:
            raise TypeError(
                f"ParameterServerStrategy needs a cluster resolver of a parameter-server cluster "
                f"(TFConfigClusterResolver with chief, worker and ps jobs), got {type(resolver).__name__}"
            )
        ext = ParameterServerExtended(ps_cluster(), variable_partitioner, timeout, failure)
        super().__init__(ext)
        self.cluster_resolver = resolver  # tf's strategy.cluster_resolver
        ext.join()  # after binding: a worker runs the chief's functions in this strategy's scope
        if not ext.spec.is_chief:
            ext.serve()  # returns only by ending the process

    @property
    def extended(self) -> ParameterServerExtended:
        return self._extended  # type: ignore[return-value]

    def __repr__(self) -> str:
        e = self.extended
        return f"ParameterServerStrategy(num_workers={e.num_workers}, num_ps={e.num_ps})"
