"""PSClusterSpec: a parameter-server cluster (one chief, workers, ps tasks) and this process's task in it.

What ``TFConfigClusterResolver.ps_cluster()`` reads from a TF_CONFIG with a ``ps`` job, frozen.
The chief (tf's coordinator) hosts the rendezvous; every task is named ``"chief"``,
``"worker:i"`` or ``"ps:i"`` (its torch.distributed.rpc name).
"""

from __future__ import annotations

from dataclasses import dataclass

#: the task types of a parameter-server cluster
PS_TASK_TYPES = ("chief", "worker", "ps")
#: the exit code of a worker or ps task that left because its chief is gone or failed: the job's
#: outcome is the chief's (`stratagem run` reports the chief, not this task)
EXIT_CHIEF_LOST = 75  # EX_TEMPFAIL: it can run again once a chief is back


def _split(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{what}: expected 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class PSClusterSpec:
    """The chief's, workers' and ps tasks' ``host:port`` addresses and this process's task."""

    chief: str  # "host:port": the coordinator, and the rendezvous
    workers: tuple[str, ...]
    ps: tuple[str, ...]
    task_type: str  # "chief" | "worker" | "ps"
    task_id: int
    source: str = "tf_config"
    restart_count: int = 0  # how many times this task was restarted (STRATAGEM_RESTART_COUNT)

    def __post_init__(self) -> None:
        if self.task_type not in PS_TASK_TYPES:
            raise ValueError(f"task type {self.task_type!r} is not one of {list(PS_TASK_TYPES)}")
        count = {"chief": 1, "worker": len(self.workers), "ps": len(self.ps)}[self.task_type]
        if not 0 <= self.task_id < count:
            raise ValueError(
                f"task {self.task_type}:{self.task_id} is outside the cluster's {count} "
                f"{self.task_type} task(s)"
            )
        if not self.workers or not self.ps:
            raise ValueError(
                f"a parameter-server cluster needs at least one worker and one ps task, got "
                f"{len(self.workers)} worker(s) and {len(self.ps)} ps"
            )
        if self.restart_count < 0:
            raise ValueError(f"restart_count must be >= 0, got {self.restart_count}")
        _split(self.chief, "the chief's address")

    @property
    def rpc_name(self) -> str:
        """This task's name: ``"chief"``, ``"worker:0"``, ``"ps:1"``."""
        return "chief" if self.task_type == "chief" else f"{self.task_type}:{self.task_id}"

    @property
    def master_addr(self) -> str:
        """The chief's host: the rendezvous."""
        return _split(self.chief, "the chief's address")[0]

    @property
    def master_port(self) -> int:
        """The chief's port: the rendezvous."""
        return _split(self.chief, "the chief's address")[1]

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def num_ps(self) -> int:
        return len(self.ps)

    @property
    def is_chief(self) -> bool:
        return self.task_type == "chief"

    @property
    def address(self) -> str:
        """This task's own ``host:port``."""
        if self.task_type == "chief":
            return self.chief
        return (self.workers if self.task_type == "worker" else self.ps)[self.task_id]

    @property
    def rpc_names(self) -> tuple[str, ...]:
        """Every task's name: the chief, the workers, then the ps tasks (the order of :attr:`rank`)."""
        return ("chief", *(f"worker:{i}" for i in range(self.num_workers)), *(f"ps:{i}" for i in range(self.num_ps)))

    @property
    def world_size(self) -> int:
        """The number of tasks: 1 + workers + ps."""
        return 1 + self.num_workers + self.num_ps

    @property
    def rank(self) -> int:
        """This task's place in :attr:`rpc_names` (chief 0, workers 1..N, then the ps tasks)."""
        return self.rpc_names.index(self.rpc_name)

    def describe(self) -> str:
        return (
            f"{self.rpc_name} of a cluster of chief {self.chief}, {self.num_workers} worker(s) "
            f"[{', '.join(self.workers)}], {self.num_ps} ps [{', '.join(self.ps)}] "
            f"(rendezvous {self.chief}; from {self.source}; restart {self.restart_count})"
        )
