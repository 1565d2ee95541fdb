"""Which device each replica of this machine computes on: a pure plan, decided before any
process group exists, so a bad choice is an error at construction, never an NCCL failure later.

tf.distribute's rules where it has them: no devices given means every visible GPU (one replica
each), or one CPU replica when there is none. ``devices="cpu"`` is N CPU replicas (gloo);
``devices="cuda"`` one replica per GPU. Two replicas never share one GPU: NCCL cannot run two
ranks on one device, so that is refused, naming both replicas and the device.
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_devices(
    devices: str | Sequence[str] | None, num_replicas: int | None, gpu_count: int, *, what: str
) -> list[str]:
    """The device of each local replica, as strings (``["cuda:0", "cuda:1"]``, ``["cpu"] * 2``)."""
    if num_replicas is not None and num_replicas < 1:
        raise ValueError(f"{what}: num_replicas must be >= 1, got {num_replicas}")
    if isinstance(devices, str):
        kind = devices.lower()
        if kind == "cpu":
            return ["cpu"] * (num_replicas or 1)
        if kind in ("cuda", "gpu"):
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
                raise ValueError(f"{what}: device {d} of replica {i} is not available (this machine has {gpu_count} GPUs)")
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
    text = str(d).lower()
    if text == "cpu" or text.startswith("cpu:"):
        return "cpu"
    if text in ("cuda", "gpu"):
        return "cuda:0"
    if text.startswith(("cuda:", "gpu:")):
        return "cuda:" + str(int(text.split(":", 1)[1]))
    raise ValueError(f"unknown device {d!r}; use 'cpu', 'cuda' or 'cuda:<index>'")


def _check_enough(n: int, gpu_count: int, what: str) -> None:
    if n > gpu_count:
        raise ValueError(
            f"{what}: {n} replicas but this machine has {gpu_count} GPU(s), and two replicas "
            "cannot share one GPU (NCCL runs one rank per device). Use "
            f"{what}(num_replicas={n}, devices='cpu') (or devices=['cpu'] * {n}) for CPU "
            f"replicas, or at most {gpu_count} replicas on the GPUs"
        )
