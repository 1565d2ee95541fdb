"""Which device each replica of this machine computes on: a pure plan, decided before any
process group exists, so a bad choice is an error at construction, never an NCCL failure later.

tf.distribute's rules where it has them: no devices given means every visible GPU (one replica
each), or one CPU replica when there is none. ``devices="cpu"`` is N CPU replicas (gloo);
``devices="cuda"`` one replica per GPU. Two replicas never share one GPU: NCCL cannot run two
ranks on one device, so that is refused, naming both replicas and the device.

TensorFlow's device names are understood as TensorFlow means them: ``"/gpu:0"``,
``"/device:GPU:1"``, ``"GPU:0"`` and ``"/job:worker/replica:0/task:0/device:GPU:0"`` are CUDA
devices (``cuda:0``, ``cuda:1``), ``"/cpu:0"`` and ``"/device:CPU:0"`` the CPU
(:func:`torch_device_name`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

# tf's device specification: optional /job:, /replica:, /task: parts, then the device, as
# "/device:GPU:0", "/gpu:0" or "GPU:0" (tf.DeviceSpec.from_string)
_TF_PART = re.compile(r"^(job|replica|task|device):(.*)$")
_TF_DEVICE = re.compile(r"^([A-Za-z_]+)(?::(\d+|\*))?$")


def torch_device_name(name: str, *, what: str = "device") -> str:
    """The torch device string of a device name: torch's own (``"cpu"``, ``"cuda"``,
    ``"cuda:1"``, ``"gpu:1"``) or TensorFlow's (``"/gpu:0"`` -> ``"cuda:0"``, ``"/cpu:0"`` ->
    ``"cpu"``, ``"/job:worker/replica:0/task:0/device:GPU:1"`` -> ``"cuda:1"``). ``"cuda"``
    alone stays ``"cuda"`` (the current GPU); other kinds (TPU, XLA) are an error naming the
    strategy that runs them."""
    text = str(name).strip()
    device = text[len("device:"):] if text.lower().startswith("device:") else text  # "device:GPU:0"
    if "/" in text:
        parts = [p for p in text.split("/") if p]
        device = ""
        for part in parts:
            m = _TF_PART.match(part)
            if m is None:
                if device or not _TF_DEVICE.match(part):
                    raise ValueError(f"{what}: cannot read the device name {name!r}; {_USE}")
                device = part  # "/gpu:0"
            elif m.group(1) == "device":
                device = m.group(2)
            elif m.group(1) == "task" and m.group(2) not in ("0", "*"):
                raise ValueError(
                    f"{what}: {name!r} names a device of task {m.group(2)}; a strategy places "
                    "this process's replica on this machine only (its peers are found by the "
                    "cluster resolver): give the device without /job:/task: (e.g. '/gpu:0')"
                )
        if not device:
            raise ValueError(f"{what}: {name!r} names no device; {_USE}")
    m = _TF_DEVICE.match(device)
    if m is None:
        raise ValueError(f"{what}: unknown device {name!r}; {_USE}")
    kind, index = m.group(1).lower(), m.group(2)
    if index == "*":
        index = None
    if kind == "cpu":
        return "cpu"
    if kind in ("gpu", "cuda"):
        return "cuda" if index is None else f"cuda:{int(index)}"
    if kind in ("tpu", "xla", "xla_gpu", "xla_cpu", "tpu_system"):
        raise ValueError(f"{what}: unknown device {name!r} here: XLA/TPU devices run under sg.TPUStrategy")
    raise ValueError(f"{what}: unknown device {name!r}; {_USE}")


#: torch device kinds a strategy's one device may also be (torch's names, passed to torch as they are)
_OTHER_TORCH = ("mps", "xpu", "meta", "hpu", "mtia", "privateuseone")


def to_torch_device(device: object, *, what: str = "device") -> torch.device:
    """The one reading of a device a user gives: a ``torch.device``; torch's names (``"cpu"``,
    ``"cuda:1"``, ``"mps"``); TensorFlow's (``"CPU:0"``, ``"/cpu:0"``, ``"GPU:0"``,
    ``"/device:GPU:1"``, ``"/job:localhost/replica:0/task:0/device:CPU:0"``). ``cpu:0`` and
    TensorFlow's ``CPU:0`` are torch's ``cpu``. Anything else is a ValueError naming what was
    received and the names understood."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"{what}: a device is a string or a torch.device, got {device!r} ({type(device).__name__}); {_USE}")
    kind = device.strip().split(":", 1)[0].lower()
    if kind in _OTHER_TORCH:
        try:
            return torch.device(device.strip())
        except RuntimeError as e:
            raise ValueError(f"{what}: cannot read the device {device!r} ({e}); {_USE}") from None
    return torch.device(torch_device_name(device, what=what))


_USE = (
    "use 'cpu', 'cuda', 'cuda:<index>' or TensorFlow's '/cpu:0', '/gpu:<index>', "
    "'/device:GPU:<index>'"
)


def plan_devices(
    devices: str | Sequence[str] | None, num_replicas: int | None, gpu_count: int, *, what: str
) -> list[str]:
    """The device of each local replica, as strings (``["cuda:0", "cuda:1"]``, ``["cpu"] * 2``)."""
    if num_replicas is not None and num_replicas < 1:
        raise ValueError(f"{what}: num_replicas must be >= 1, got {num_replicas}")
    if isinstance(devices, str):
        kind = torch_device_name(devices, what=f"{what}(devices={devices!r})")
        if kind == "cpu":  # "cpu", "/cpu:0": num_replicas CPU replicas
            return ["cpu"] * (num_replicas or 1)
        if kind == "cuda":
            if gpu_count == 0:
                raise ValueError(f"{what}(devices={devices!r}): this machine has no GPU; use devices='cpu'")
            n = num_replicas or gpu_count
            _check_enough(n, gpu_count, what)
            return [f"cuda:{i}" for i in range(n)]
        devices = [devices]
    if devices is not None:
        plan = [_normal(d) for d in devices]
        if not plan:
            raise ValueError(f"{what}(devices=[]) needs at least one device")
        if num_replicas is not None and num_replicas != len(plan):
            raise ValueError(f"{what}: devices={list(devices)} gives {len(plan)} replicas but num_replicas={num_replicas}")
        for i, d in enumerate(plan):
            if d.startswith("cuda") and int(d.split(":")[1]) >= gpu_count:
                given = list(devices)[i]
                asked = f"{given!r} ({d})" if str(given) != d else d
                has = f"{gpu_count} GPU(s): cuda:0..cuda:{gpu_count - 1}" if gpu_count else "no GPU"
                raise ValueError(
                    f"{what}: device {asked} of replica {i} is not available: this machine has {has}"
                    + ("; use '/cpu:0' (or devices='cpu') for CPU replicas" if not gpu_count else "")
                )
            if d.startswith("cuda") and d in plan[:i]:
                raise ValueError(
                    f"{what}: replicas {plan.index(d)} and {i} would both use {d}; two replicas "
                    "cannot share one GPU (NCCL runs one rank per device). Give each replica its "
                    "own GPU, or use CPU replicas: devices='cpu'"
                )
        return plan
    if gpu_count == 0:
        return ["cpu"] * (num_replicas or 1)
    n = num_replicas or gpu_count
    _check_enough(n, gpu_count, what)
    return [f"cuda:{i}" for i in range(n)]


def _normal(d: str) -> str:
    name = torch_device_name(d, what=f"device {d!r}")
    return "cuda:0" if name == "cuda" else name


def _check_enough(n: int, gpu_count: int, what: str) -> None:
    if n > gpu_count:
        raise ValueError(
            f"{what}: {n} replicas but this machine has {gpu_count} GPU(s), and two replicas "
            "cannot share one GPU (NCCL runs one rank per device). Use "
            f"{what}(num_replicas={n}, devices='cpu') (or devices=['cpu'] * {n}) for CPU "
            f"replicas, or at most {gpu_count} replicas on the GPUs"
        )
