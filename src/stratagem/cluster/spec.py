"""ProcessEnv: this process's place in the job, read once from the environment into a frozen value."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: environment variables torchrun (and ``stratagem run``) export to each worker.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ProcessEnv:
    """Where this process stands: its rank among ``world_size`` processes and the rendezvous."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "self" (MirroredStrategy started it) or "single"
    restart_count: int = 0

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)

    @classmethod
    def single(cls) -> ProcessEnv:
        """A job of one process that has no peers to meet."""
        return cls(0, 1, 0, 1, "127.0.0.1", 0, "single")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ProcessEnv | None:
        """The launch this process was started by, or None when no launcher started it."""
        env = os.environ if environ is None else environ
        if not all(k in env for k in LAUNCH_VARS):
            missing = [k for k in LAUNCH_VARS if k in env]
            if missing:
                raise RuntimeError(
                    f"found {missing} in the environment but not all of {list(LAUNCH_VARS)}; "
                    "start the script with `stratagem run -n N script.py` or torchrun, or unset them"
                )
            return None
        try:
            rank = int(env["RANK"])
            world = int(env["WORLD_SIZE"])
            local_rank = int(env.get("LOCAL_RANK", rank))
            local_world = int(env.get("LOCAL_WORLD_SIZE", world))
            port = int(env["MASTER_PORT"])
            restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except ValueError as e:
            raise RuntimeError(f"malformed launch environment: {e}") from e
        if not 0 <= rank < world:
            raise RuntimeError(f"RANK={rank} is outside WORLD_SIZE={world}")
        launcher = env.get("STRATAGEM_LAUNCHER", "torchrun")
        return cls(rank, world, local_rank, local_world, env["MASTER_ADDR"], port, launcher, restarts)

    def to_environ(self) -> dict[str, str]:
        """The variables that make a child process join this job as ``self.rank``."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "STRATAGEM_LAUNCHER": self.launcher,
        }
