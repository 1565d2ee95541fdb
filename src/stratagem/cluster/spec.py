"""ClusterSpec: where this process stands in the job, one frozen value for every launcher.

Resolvers (TF_CONFIG, Slurm, by hand), torchrun / ``stratagem run`` (:meth:`ClusterSpec.from_environ`)
and the self-launch of a plain ``python train.py`` (``cluster.launch.ensure_replicas``) all
produce this one type, and ``distribute.join`` takes only it. The environment is read here and
in the resolvers, once, at the edge.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: environment variables torchrun (and ``stratagem run``) export to each worker.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


#: where the store is when not on rank 0: "launcher" (a store keeper the launcher started)
STORE_VAR = "STRATAGEM_STORE"


@dataclass(frozen=True)
class ClusterSpec:
    """Where this process stands in the cluster: workers, its task, its rank, the rendezvous."""

    workers: tuple[str, ...]  # one entry per worker (machine); "" where the launcher does not say
    task_index: int  # this process's worker
    rank: int  # this process's rank among all processes (replicas)
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str  # the chief's rendezvous store
    master_port: int
    chief: int = 0  # the worker whose first process is rank 0
    source: str = "simple"  # who described the job: torchrun, self, tf_config, slurm, simple, single
    restart_count: int = 0
    agent_store: bool = False  # the store is hosted by torchrun's agent, not by rank 0
    #: the store is hosted by a process of the launcher's that trains nothing (a store keeper:
    #: ``cluster/store_keeper.py``), so every replica, rank 0 too, can be lost (``STRATAGEM_STORE=launcher``)
    launcher_store: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0 <= self.task_index < max(len(self.workers), 1):
            raise ValueError(f"task index {self.task_index} is outside {len(self.workers)} workers")

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def master(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    @property
    def launcher(self) -> str:
        """"single" for a job of one process, else who described it (``source``)."""
        return "single" if self.world_size == 1 else self.source

    def describe(self) -> str:
        where = ", ".join(w or "?" for w in self.workers)
        return (
            f"rank {self.rank} of {self.world_size} (worker {self.task_index} of "
            f"{self.num_workers}: [{where}]; rendezvous {self.master}; from {self.source})"
        )

    # --- what every process of one job must be told alike -----------------------------------
    def view(self) -> dict[str, object]:
        """The job as this process was told it, apart from its own place in it (the processes,
        the workers, the rendezvous): every process of one job must be told the same, which the
        rendezvous checks (``distribute.views``)."""
        return {"processes": self.world_size, "workers": list(self.workers), "rendezvous": self.master}

    def summary(self) -> str:
        """``view()`` in a few words, of a size that does not grow with the job."""
        return f"{self.world_size} processes on {self.num_workers} workers, rendezvous {self.master}"

    @property
    def task_name(self) -> str:
        """This process's task as its cluster description names it (``worker 1``)."""
        return f"worker {self.task_index}"

    # --- the launch environment --------------------------------------------------------------
    @classmethod
    def single(cls) -> ClusterSpec:
        """A job of one process that has no peers to meet."""
        return cls(("",), 0, 0, 1, 0, 1, "127.0.0.1", 0, source="single")

    @classmethod
    def local(cls, rank: int, world_size: int, port: int, source: str = "self") -> ClusterSpec:
        """Process ``rank`` of ``world_size`` on this machine, meeting at ``127.0.0.1:port``."""
        return cls(("127.0.0.1",), 0, rank, world_size, rank, world_size, "127.0.0.1", port, source=source)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ClusterSpec | None:
        """The launch (torchrun, ``stratagem run``, a self-launched replica) that started this
        process, or None when no launcher started it."""
        env = os.environ if environ is None else environ
        if not all(k in env for k in LAUNCH_VARS):
            present = [k for k in LAUNCH_VARS if k in env]
            if present:
                raise RuntimeError(
                    f"found {present} in the environment but not all of {list(LAUNCH_VARS)}; "
                    "start the script with `stratagem run -n N script.py` or torchrun, or unset them"
                )
            return None
        try:
            rank = int(env["RANK"])
            world = int(env["WORLD_SIZE"])
            local_rank = int(env.get("LOCAL_RANK", rank))
            local_world = max(int(env.get("LOCAL_WORLD_SIZE", world)), 1)
            port = int(env["MASTER_PORT"])
            restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
            nnodes = -(-world // local_world)
            node = int(env.get("GROUP_RANK", rank // local_world))
        except ValueError as e:
            raise RuntimeError(f"malformed launch environment: {e}") from e
        if not 0 <= rank < world:
            raise RuntimeError(f"RANK={rank} is outside WORLD_SIZE={world}")
        return cls(
            tuple("" for _ in range(nnodes)), min(node, nnodes - 1), rank, world, local_rank,
            local_world, env["MASTER_ADDR"], port, 0, env.get("STRATAGEM_LAUNCHER", "torchrun"),
            restarts, env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            env.get(STORE_VAR, "") == "launcher",
        )  # fmt: skip

    def to_environ(self) -> dict[str, str]:
        """The variables that make a child process join this job as ``self.rank``."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "STRATAGEM_LAUNCHER": self.source,
            **({STORE_VAR: "launcher"} if self.launcher_store else {}),
        }

    @property
    def store_outside(self) -> bool:
        """Whether the job's store lives outside the replicas (torchrun's agent, a store keeper)."""
        return self.agent_store or self.launcher_store
