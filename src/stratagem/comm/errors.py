"""The errors communication raises: a failed worker named by rank, a mismatch across replicas."""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective could not complete (a peer failed, timed out or disagreed)."""


class WorkerFailedError(CollectiveError):
    """Another worker of the job failed; ``rank`` names it when it is known."""

    def __init__(self, message: str, rank: int | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


class CollectiveTimeoutError(CollectiveError):
    """A collective waited longer than the configured timeout for its peers."""


class ReplicaMismatchError(ValueError):
    """Replicas passed different structures, shapes or dtypes to the same collective."""


class CollectiveMismatchError(ReplicaMismatchError, CollectiveError):
    """Replicas wait in different collectives (the n-th of one is not the n-th of another), so
    none of them can finish: a mistake in the program, found by the failure monitor."""


_PEER_LOSS = ("connection", "closed", "reset by peer", "broken pipe", "eof", "peer", "socket")


def looks_like_peer_loss(message: str) -> bool:
    """Whether a backend error message says the other side went away."""
    lowered = message.lower()
    return any(word in lowered for word in _PEER_LOSS)
