"""The checkpoint writer interface: what ``CheckpointManager`` hands a writer, and what it calls.

A writer (as torchft's ``CheckpointTransport``) turns a checkpoint's objects into files and back;
the manager chooses one per save or restore and gives it a ``WriteSite``: the job's
communicator, the directory, the checkpoint's objects and the manager's few collective steps
(hold the directory, agree on a problem, prune). Two writers: ``PortableWriter`` (portable.py:
whole files, the chief writes) and ``ShardedWriter`` (sharded.py: torch.distributed.checkpoint,
every rank its part). Writers import this module and the ones below it, never the manager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from stratagem.comm import Communicator
    from stratagem.distribute.strategy import StrategyExtended


@dataclass
class WriteSite:
    """What a writer may use of the manager, for one save or restore.

    ``objects`` is the checkpoint's own dict of objects by name (read it; ``replace`` an object,
    as restoring an int step does). ``own_directory`` (on the chief: hold the directory's writer
    lock), ``agree`` (every replica: raise what the chief met) and ``prune`` (on the chief: drop
    what ``max_to_keep`` no longer keeps) are the manager's. ``all_per_rank``: every rank holds
    different model state (pipeline stages). ``on_file_written``: a test's hook, called with each
    file's name as it is written."""

    comm: Communicator
    directory: Path
    objects: dict[str, Any]
    extended: StrategyExtended
    all_per_rank: bool
    own_directory: Callable[[], None]
    agree: Callable[[tuple[str, str]], None]
    prune: Callable[[], None]
    on_file_written: Callable[[str], None] | None = None

    def replace(self, name: str, obj: Any) -> None:
        """The checkpoint holds ``obj`` as ``name`` from now on (a restored int or float)."""
        self.objects[name] = obj


class CheckpointWriter(Protocol):
    """Writes a checkpoint's objects at a step, and reads them back, over a ``WriteSite``.

    Both calls are collective: every replica makes them, in the same order, and a failure on
    one replica is raised on all."""

    def save(self, site: WriteSite, step: int) -> str:
        """Write ``site.objects`` as ``site.directory/ckpt-<step>``; returns its path (everywhere)."""
        ...

    def prepare(self, site: WriteSite, path: Path, meta: dict[str, Any]) -> Callable[[], None]:
        """Read this replica's states from the verified checkpoint at ``path`` (``meta``: its
        metadata) and validate them against ``site.objects``; returns the assignment, called
        only once every replica's preparation passed."""
        ...
