"""The step-by-step bootstrap: ``connect_to_cluster(resolver)``, then ``initialize_system(resolver)``.

As with TF's accelerator bootstrap (resolve the cluster -> connect -> initialize -> strategy):
``connect_to_cluster`` forms the process group (finite timeout; the error names the address it
could not reach), ``initialize_system`` checks that every worker runs the same stratagem and
torch, sees the same world size and was given the same configuration, and names the worker that
differs. ``MultiWorkerMirroredStrategy(resolver)`` then uses the group these made.
"""

from __future__ import annotations

import enum
import numbers
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
from stratagem.distribute.devices import plan_devices, to_torch_device, torch_device_name
from stratagem.distribute.join import join
from stratagem.distribute.views import ClusterConfigurationError

__all__ = [
    "ClusterConfigurationError",
    "CommunicationImplementation",
    "CommunicationOptions",
    "check_agreement",
    "connect_to_cluster",
    "default_device",
    "initialize_system",
    "local_facts",
]


class CommunicationImplementation(enum.Enum):
    """TF's ``tf.distribute.experimental.CommunicationImplementation``: which collectives the
    workers use. ``AUTO``: NCCL on GPU replicas, gloo on CPU ones; ``NCCL``: torch's nccl backend
    (GPU replicas only); ``RING``: gloo's ring collectives (CPU replicas)."""

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"

    @classmethod
    def of(cls, value: object) -> CommunicationImplementation:
        """``value`` as a member: a member, its name in any case (``"nccl"``), or TF's own enum."""
        if isinstance(value, cls):
            return value
        name = getattr(value, "name", value)  # tf.distribute.experimental.CommunicationImplementation.NCCL
        if isinstance(name, str) and name.upper() in cls.__members__:
            return cls[name.upper()]
        raise ValueError(
            f"CommunicationOptions(implementation=...) takes CommunicationImplementation.AUTO, RING or NCCL "
            f"(or 'AUTO', 'RING', 'NCCL'), got {value!r}"
        )


#: torch's own bound on a collective (torch.distributed's default process-group timeout), used
#: for TF's ``timeout_seconds=None`` (no timeout)
NO_TIMEOUT_SECONDS = 1800.0


@dataclass(frozen=True)
class CommunicationOptions:
    """How the workers communicate (TF's ``tf.distribute.experimental.CommunicationOptions``).

    ``implementation``: ``AUTO`` (NCCL on GPU replicas, gloo on CPU), ``NCCL`` (torch's nccl
    backend: the replicas are the GPUs; an error where there is none) or ``RING`` (gloo: the
    replicas are CPU processes). ``bytes_per_pack``: the size of the gradient reducer's buckets in
    bytes (0, TF's default: ``bucket_cap_mb``, 25 MB). ``timeout_seconds``: every collective waits
    at most this long (default 120; None, TF's "no timeout": torch's own default, 30 minutes).
    ``failure`` says how fast a dead peer is found."""

    bytes_per_pack: int = 0
    timeout_seconds: float | None = 120.0
    implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO
    bucket_cap_mb: float = 25.0
    failure: FailureOptions = field(default_factory=FailureOptions)

    def __post_init__(self) -> None:
        object.__setattr__(self, "implementation", CommunicationImplementation.of(self.implementation))
        if self.timeout_seconds is None:
            object.__setattr__(self, "timeout_seconds", NO_TIMEOUT_SECONDS)
        t = self.timeout_seconds
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not t > 0:
            raise ValueError(f"CommunicationOptions(timeout_seconds=...) takes a number > 0 or None, got {t!r}")
        b = self.bytes_per_pack
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 0:
            raise ValueError(
                f"CommunicationOptions(bytes_per_pack=...) takes a whole number of bytes >= 0 (0: the "
                f"default bucket size), got {b!r}"
            )
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")

    @property
    def timeout(self) -> float:
        """``timeout_seconds`` as a number (None was read as torch's default)."""
        return float(self.timeout_seconds or NO_TIMEOUT_SECONDS)

    @property
    def bucket_bytes(self) -> int:
        """The gradient reducer's bucket size: ``bytes_per_pack``, else ``bucket_cap_mb``."""
        return int(self.bytes_per_pack) if self.bytes_per_pack else int(self.bucket_cap_mb * 1024 * 1024)

    @property
    def first_bucket_bytes(self) -> int | None:
        """The first bucket's size (DDP's 1 MB, started early in backward), at most ``bytes_per_pack``
        (None: the reducer's own)."""
        return min(1024 * 1024, int(self.bytes_per_pack)) if self.bytes_per_pack else None

    def devices(self, devices: str | None, cuda_count: int, what: str) -> str | None:
        """The ``devices`` argument ``implementation`` asks for: NCCL needs GPU replicas (an
        error naming RING/AUTO where CUDA is absent or ``devices="cpu"``), RING CPU replicas (an
        error for GPU ones), AUTO leaves ``devices`` as given."""
        impl = self.implementation
        kind = None if devices is None else torch_device_name(devices, what=f"{what}(devices={devices!r})")
        if impl is CommunicationImplementation.NCCL:
            if cuda_count == 0:
                raise ValueError(
                    f"{what}: CommunicationOptions(implementation=NCCL) runs torch's nccl backend, which needs "
                    "CUDA GPUs, and CUDA is not available on this machine; use "
                    "CommunicationImplementation.RING or AUTO (gloo on CPU)"
                )
            if kind == "cpu":
                raise ValueError(
                    f"{what}: CommunicationOptions(implementation=NCCL) runs on GPU replicas but devices={devices!r} "
                    "asks for CPU ones; use implementation=RING (gloo) for CPU replicas, or devices='cuda'"
                )
            return "cuda"
        if impl is CommunicationImplementation.RING:
            if kind is not None and kind != "cpu":
                raise ValueError(
                    f"{what}: CommunicationOptions(implementation=RING) runs gloo on CPU replicas but "
                    f"devices={devices!r} asks for GPUs; use implementation=NCCL or AUTO for GPU replicas"
                )
            return "cpu"
        return devices


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
    if device is not None:
        dev = to_torch_device(device, what="connect_to_cluster(device=...)")
        options.devices(dev.type, torch.cuda.device_count(), "connect_to_cluster")  # NCCL on a CPU: an error
    else:
        dev = default_device(spec, options.devices(None, torch.cuda.device_count(), "connect_to_cluster"))
    return join(spec, dev, timeout=options.timeout, failure=options.failure)


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
