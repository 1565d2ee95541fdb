"""comm: a thin layer over torch.distributed: nested collectives, timeouts, named failures, the
bucketed gradient reducer."""

from stratagem.comm.communicator import (
    Communicator,
    LocalCommunicator,
    ProcessGroupCommunicator,
    init_process_group,
    release_groups,
)
from stratagem.comm.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ReplicaMismatchError,
    WorkerFailedError,
)

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Communicator",
    "LocalCommunicator",
    "ProcessGroupCommunicator",
    "ReplicaMismatchError",
    "WorkerFailedError",
    "init_process_group",
    "release_groups",
]
