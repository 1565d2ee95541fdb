"""TPUClusterResolver: the chips of this host, and on a pod this host's place among the workers.

TensorFlow's ``TPUClusterResolver(tpu)`` takes a gRPC address (a remote TPU *node*), a TPU name or
nothing. PyTorch/XLA drives TPUs only from the machine the chips are attached to (a TPU VM, through
libtpu): there is no remote TPU-node mode, so an address naming another machine is a clear error
here, not a connection that hangs. ``tpu=None`` (or ``"local"``, or a name) means the chips of
this host; on a pod (several hosts, one process each) the environment the TPU VM image sets
(``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``) says which worker this host is and who coordinates.

No TPU? ``PJRT_DEVICE=CPU`` (with ``CPU_NUM_DEVICES=N``) makes the same program run on N XLA
devices on the CPU: that is how stratagem's XLA tests run.

Reads the environment once, at ``__init__``; imports nothing of torch_xla.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import final
from urllib.parse import urlparse

from stratagem.cluster.resolvers import ClusterResolver
from stratagem.cluster.spec import ClusterSpec

__all__ = ["TPUClusterResolver", "TPUUnavailableError"]

# the port torch_xla's PJRT runtime coordinates a multi-host (pod) job on
COORDINATOR_PORT = 8476
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0", ""}


class TPUUnavailableError(RuntimeError):
    """No TPU reachable as asked (a remote TPU node, or no TPU and no ``PJRT_DEVICE``)."""


def _how_to_test() -> str:
    return (
        "to run the same program without a TPU, set PJRT_DEVICE=CPU (and CPU_NUM_DEVICES=N for N "
        "XLA devices on the CPU) before starting Python"
    )


def _has_tpu_chips() -> bool:
    """Whether this host has TPU chips attached (the accel devices libtpu opens)."""
    try:
        names = os.listdir("/dev")
    except OSError:
        return False
    return any(n.startswith("accel") or n.startswith("vfio") for n in names)


@final
class TPUClusterResolver(ClusterResolver):
    """The TPU system of this host (``tpu=None``, ``"local"`` or a TPU name), read once.

    ``tpu`` may also be ``"grpc://host:port"`` (TF's ``COLAB_TPU_ADDR`` form): accepted when the
    host is this machine, otherwise a ``TPUUnavailableError`` saying that PyTorch/XLA drives only
    the chips of the machine it runs on. With ``tpu=None``, ``TPU_NAME`` is read as TF does.
    """

    def __init__(self, tpu: str | None = None, *, environ: Mapping[str, str] | None = None) -> None:
        env = dict(os.environ if environ is None else environ)
        if tpu is not None and not isinstance(tpu, str):
            raise TypeError(f"TPUClusterResolver(tpu=...) takes an address, a name or None; got {type(tpu).__name__}")
        asked = tpu if tpu is not None else env.get("TPU_NAME")
        self.tpu = asked or "local"
        if self.tpu.startswith("grpc://"):
            host = urlparse(self.tpu).hostname or ""
            if host not in _LOCAL_HOSTS:
                raise TPUUnavailableError(
                    f"TPUClusterResolver({self.tpu!r}): that address names a remote TPU node; "
                    "PyTorch/XLA has no remote TPU-node mode, it drives the TPU chips of the machine "
                    "it runs on (a TPU VM). Run this program on the TPU VM with tpu=None; "
                    + _how_to_test()
                )
        self.pjrt_device = env.get("PJRT_DEVICE", "").upper()
        self.has_chips = _has_tpu_chips()
        hostnames = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
        self.worker_hostnames: tuple[str, ...] = tuple(hostnames) or ("localhost",)
        try:
            self.worker_id = int(env.get("TPU_WORKER_ID", env.get("CLOUD_TPU_TASK_ID", "0")))
        except ValueError as e:
            raise ValueError(
                f"TPU_WORKER_ID must be an integer, got {env.get('TPU_WORKER_ID')!r}"
            ) from e
        if not 0 <= self.worker_id < len(self.worker_hostnames):
            raise ValueError(
                f"TPU_WORKER_ID={self.worker_id} but TPU_WORKER_HOSTNAMES names "
                f"{len(self.worker_hostnames)} worker(s): {','.join(self.worker_hostnames)}"
            )
        self._spec = ClusterSpec(
            workers=self.worker_hostnames,
            task_index=self.worker_id,
            rank=self.worker_id,
            world_size=len(self.worker_hostnames),
            local_rank=0,
            local_world_size=1,
            master_addr=self.worker_hostnames[0],
            master_port=COORDINATOR_PORT,
            source="tpu",
        )

    def check_available(self) -> str:
        """The PJRT device this process will drive ("TPU" or what ``PJRT_DEVICE`` says), or a
        ``TPUUnavailableError`` naming what was looked for and how to test on the CPU."""
        if self.pjrt_device:
            return self.pjrt_device
        if self.has_chips:
            return "TPU"
        raise TPUUnavailableError(
            f"TPUClusterResolver({self.tpu!r}): no TPU found on this machine (looked for TPU "
            "devices /dev/accel* and /dev/vfio/*, and for the PJRT_DEVICE variable: neither is "
            "present); " + _how_to_test()
        )

    @property
    def coordinator_address(self) -> str:
        """``host:port`` of worker 0, where the PJRT runtime of a pod meets."""
        return f"{self.worker_hostnames[0]}:{COORDINATOR_PORT}"

    @property
    def is_pod(self) -> bool:
        return len(self.worker_hostnames) > 1

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def __repr__(self) -> str:
        return (
            f"TPUClusterResolver(tpu={self.tpu!r}, worker {self.worker_id} of "
            f"{len(self.worker_hostnames)}, coordinator {self.coordinator_address})"
        )
