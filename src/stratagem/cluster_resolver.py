"""stratagem.cluster_resolver: the cluster resolvers of ``stratagem.cluster.resolvers``."""

from stratagem.cluster.resolvers import *  # noqa: F403
from stratagem.cluster.resolvers import __all__  # noqa: F401
