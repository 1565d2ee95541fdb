"""stratagem.cluster_resolver: the cluster resolvers of ``stratagem.cluster.resolvers`` and the
TPU resolver of ``stratagem.cluster.tpu``."""

from stratagem.cluster.resolvers import *  # noqa: F403
from stratagem.cluster.resolvers import __all__ as _resolvers_all
from stratagem.cluster.tpu import TPUClusterResolver, TPUUnavailableError

__all__ = [*_resolvers_all, "TPUClusterResolver", "TPUUnavailableError"]
