"""TPUStrategy and ``initialize_tpu_system``: the last two lines of TF's TPU bootstrap.

```python
resolver = sg.cluster_resolver.TPUClusterResolver(tpu=None)
sg.connect_to_cluster(resolver)
sg.initialize_tpu_system(resolver)
strategy = sg.TPUStrategy(resolver)
```

One process per host drives all of its XLA devices (TPU cores, or ``PJRT_DEVICE=CPU`` devices) as
one SPMD program (``distribute.engines.xla``). On a pod each host runs the same script once.
"""

from __future__ import annotations

from typing import final

from stratagem.cluster.tpu import TPUClusterResolver
from stratagem.distribute.engines.xla import XLAExtended, XLARuntime, start_runtime
from stratagem.distribute.strategy import Strategy


def initialize_tpu_system(
    resolver: TPUClusterResolver | None = None, *, cache_dir: str | None = None
) -> XLARuntime:
    """Make the TPU system ready: the PJRT runtime in SPMD mode (and, with ``cache_dir``, the
    persistent compilation cache). Idempotent; call it before any tensor is put on an XLA
    device, since SPMD fixes the device count when the runtime starts."""
    resolver = _resolver(resolver, "initialize_tpu_system")
    resolver.check_available()
    return start_runtime(cache_dir)


def _resolver(resolver: object, what: str) -> TPUClusterResolver:
    if resolver is None:
        return TPUClusterResolver()
    if not isinstance(resolver, TPUClusterResolver):
        raise TypeError(
            f"{what} takes a stratagem.cluster_resolver.TPUClusterResolver (or None: this host's "
            f"TPU), got {type(resolver).__name__}; for GPUs and CPUs use MirroredStrategy or "
            "MultiWorkerMirroredStrategy"
        )
    return resolver


@final
class TPUStrategy(Strategy):
    """Data parallelism over every XLA device of this host: parameters replicated, each global
    batch sharded on its batch dimension, the step compiled once by XLA and reused.

    ``num_replicas_in_sync`` is the number of devices. Inside ``run`` the one SPMD program sees
    the global batch (values are global: the replica context's ``all_reduce`` is the identity,
    ``experimental_local_results`` has one value per host).
    """

    def __init__(self, tpu_cluster_resolver: TPUClusterResolver | None = None) -> None:
        self.resolver = _resolver(tpu_cluster_resolver, "TPUStrategy")
        runtime = initialize_tpu_system(self.resolver)
        self.device = runtime.device
        super().__init__(XLAExtended(runtime, name="TPUStrategy"))
