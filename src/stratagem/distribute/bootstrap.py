"""The step-by-step bootstrap: ``connect_to_cluster(resolver)``, then ``initialize_system(resolver)``.

As with TF's accelerator bootstrap (resolve the cluster -> connect -> initialize -> strategy):
``connect_to_cluster`` forms the process group (finite timeout; the error names the address it
could not reach), ``initialize_system`` checks that every worker runs the same stratagem and
torch, sees the same world size and was given the same configuration, and names the worker that
differs. ``MultiWorkerMirroredStrategy(resolver)`` then uses the group these made.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from stratagem._version import __version__
from stratagem.cluster.resolvers import ClusterResolver, ClusterSpec, detect
from stratagem.cluster.tpu import TPUClusterResolver
from stratagem.comm import Communicator, LocalCommunicator
from stratagem.comm.failure import FailureOptions
from stratagem.distribute.devices import plan_devices
from stratagem.distribute.join import join
from stratagem.distribute.views import ClusterConfigurationError

__all__ = [
    "ClusterConfigurationError",
    "CommunicationOptions",
    "check_agreement",
    "connect_to_cluster",
    "default_device",
    "initialize_system",
    "local_facts",
]


@dataclass(frozen=True)
class CommunicationOptions:
    """How the workers communicate: every collective waits at most ``timeout_seconds``; gradients
    are all-reduced in buckets of ``bucket_cap_mb``; ``failure`` says how fast a dead peer is found."""

    timeout_seconds: float = 120.0
    bucket_cap_mb: float = 25.0
    failure: FailureOptions = field(default_factory=FailureOptions)

    def __post_init__(self) -> None:
        if self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {self.timeout_seconds}")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")


def _spec(resolver: ClusterResolver | None) -> ClusterSpec:
    return (resolver if resolver is not None else detect()).cluster_spec()


def default_device(spec: ClusterSpec, devices: str | None = None) -> torch.device:
    """This process's device by ``plan_devices``: GPU ``local_rank`` when this machine has a GPU
    for each of its processes, the CPU when it has none or ``devices="cpu"``; an error naming
    ``devices="cpu"`` when there are GPUs, but fewer than processes."""
    plan = plan_devices(devices, spec.local_world_size, torch.cuda.device_count(), what="this worker")
    return torch.device(plan[spec.local_rank % len(plan)])


def connect_to_cluster(
    resolver: ClusterResolver | None = None,
    communication_options: CommunicationOptions | None = None,
    *,
    device: torch.device | str | None = None,
) -> Communicator:
    """Form (or reuse) the process group of the cluster ``resolver`` describes.

    Waits at most ``timeout_seconds`` for the other workers; the error says which address could
    not be reached. Returns the Communicator of every process of the job.

    With a ``TPUClusterResolver`` there is no process group to form: each host's process drives
    its own chips and, on a pod, the XLA runtime meets the other hosts at the resolver's
    coordinator. This checks the TPU (or ``PJRT_DEVICE``) is there, with a clear error if not,
    and returns this host's one-process Communicator.
    """
    if isinstance(resolver, TPUClusterResolver):
        resolver.check_available()
        return LocalCommunicator("cpu")
    spec = _spec(resolver)
    options = communication_options or CommunicationOptions()
    dev = torch.device(device) if device is not None else default_device(spec)
    return join(spec, dev, timeout=options.timeout_seconds, failure=options.failure)


def local_facts(spec: ClusterSpec, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """What every worker must agree on, as plain values."""
    return {
        "stratagem": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "world_size": spec.world_size,
        "num_workers": spec.num_workers,
        "config": {str(k): repr(v) for k, v in sorted((config or {}).items())},
    }


def _differences(want: Mapping[str, Any], have: Mapping[str, Any], path: str = "") -> list[str]:
    out = []
    for key in sorted(set(want) | set(have)):
        a, b = want.get(key, "<missing>"), have.get(key, "<missing>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(_differences(a, b, f"{path}{key}."))
        elif a != b:
            out.append(f"{path}{key}={b} (worker 0 has {a})")
    return out


def check_agreement(comm: Communicator, spec: ClusterSpec, facts: Mapping[str, Any], what: str) -> None:
    """Raise ClusterConfigurationError on every process unless all passed equal ``facts``."""
    everyone = comm.all_gather_object(dict(facts))
    ref = everyone[0]
    problems = []
    for rank, theirs in enumerate(everyone):
        diff = _differences(ref, theirs)
        if diff:
            problems.append(f"rank {rank}: " + ", ".join(diff))
    if problems:
        raise ClusterConfigurationError(
            f"{what}: the workers disagree ({'; '.join(problems)}); start every worker with the "
            "same stratagem/torch versions and the same configuration"
        )


def initialize_system(
    resolver: ClusterResolver | None = None,
    communication_options: CommunicationOptions | None = None,
    *,
    config: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> ClusterSpec:
    """Check every worker agrees (versions, world size, options, ``config``); name any that differs.

    Call it on every worker after ``connect_to_cluster``. ``config`` is your own job settings
    (e.g. ``{"global_batch": 256}``): compared by ``repr``. On GPUs it also frees cached memory.
    """
    spec = _spec(resolver)
    options = communication_options or CommunicationOptions()
    comm = connect_to_cluster(resolver, options, device=device)
    facts = local_facts(spec, {**asdict(options), **dict(config or {})})
    if comm.world_size != spec.world_size:
        raise ClusterConfigurationError(
            f"the process group has {comm.world_size} processes but the resolver says "
            f"{spec.world_size}; connect with the same resolver"
        )
    check_agreement(comm, spec, facts, "initialize_system")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    comm.barrier()
    return spec
