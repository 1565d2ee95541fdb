"""cluster: who this process is (rank, world, address) and how replicas are started (stdlib + torch)."""

from stratagem.cluster.launch import ensure_replicas, find_free_port
from stratagem.cluster.spec import ClusterSpec

__all__ = ["ClusterSpec", "ensure_replicas", "find_free_port"]
