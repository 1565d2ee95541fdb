"""One writer per checkpoint directory: the lock file (host, pid, process start), taken over
only from a writer known to be dead, and the cleanup of what a dead writer left.

The writer (the chief of a job) holds ``<directory>/.stratagem-writer.lock`` from its first save
(or ``restore_or_initialize``) until it exits. A second job pointed at the same directory gets
``CheckpointDirectoryLockedError`` naming the holder. A lock whose holder is dead (same host, its
pid gone or reused by another process) is taken over. A holder on another host cannot be
checked from here: the error says so, and says to delete the lock file once that job has ended.

Temporary (``.tmp-ckpt-<step>+<host>+<pid>+<id>``) and set-aside (``.old-ckpt-...``) directories
carry their writer's host and pid, so cleanup removes only this writer's own or a dead writer's
leftovers (a set-aside checkpoint whose replacement never landed is renamed back first).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratagem.core.procs import pid_alive, start_time

LOCK_NAME = ".stratagem-writer.lock"
_LEFTOVER = re.compile(r"^\.(tmp|old|del)-ckpt-(\d+)\+(.+)\+(\d+)\+[0-9a-f]+$")


class CheckpointDirectoryLockedError(RuntimeError):
    """Another live writer holds the checkpoint directory."""


def _host() -> str:
    return socket.gethostname()


def writer_tag() -> str:
    """This process as a writer, for the names of its temporary directories."""
    return f"{_host()}+{os.getpid()}"


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str | None
    token: str
    since: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host} (since {when})"

    def alive(self) -> bool | None:
        """True/False on this host; None (unknown) for a holder on another host."""
        if self.host != _host():
            return None
        return pid_alive(self.pid, self.started)


def _read_holder(path: Path) -> Holder | None:
    try:
        with open(path) as f:
            raw: Any = json.load(f)
        return Holder(str(raw["host"]), int(raw["pid"]), raw.get("started"), str(raw["token"]), float(raw["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class WriterLock:
    """The lock of one checkpoint directory, held by this process (shared by its managers)."""

    _held: dict[str, WriterLock] = {}

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self.token = uuid.uuid4().hex
        self.pid = os.getpid()
        self.held = False

    @classmethod
    def of(cls, directory: Path) -> WriterLock:
        """This process's lock of ``directory`` (one per directory per process)."""
        key = os.path.realpath(directory)
        lock = cls._held.get(key)
        if lock is None or lock.pid != os.getpid():
            lock = cls(Path(directory))
            cls._held[key] = lock
        return lock

    def acquire(self) -> None:
        """Hold the directory (idempotent); raises CheckpointDirectoryLockedError if a live writer does."""
        if self.held and self.owns():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            mine = {
                "host": _host(), "pid": self.pid, "started": start_time(self.pid),
                "token": self.token, "since": time.time(),
            }  # fmt: skip
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except FileExistsError:
                self._handle_existing()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            atexit.register(self.release)
            clean_leftovers(self.directory)
            return
        raise CheckpointDirectoryLockedError(
            f"could not take the lock {self.path} (it keeps changing: several jobs are starting on "
            "this checkpoint directory); give each job its own directory"
        )

    def _handle_existing(self) -> None:
        holder = _read_holder(self.path)
        if holder is None:  # being written this instant, or a writer died between create and write
            try:
                age = time.time() - os.lstat(self.path).st_mtime
            except FileNotFoundError:
                return
            if age < 5.0:
                time.sleep(0.1)
                return
        elif holder.token == self.token:
            self.held = True
            return
        else:
            alive = holder.alive()
            if alive is None:
                raise CheckpointDirectoryLockedError(
                    f"checkpoint directory {self.directory} is held by another writer: "
                    f"{holder.describe()} (lock file {self.path}); a holder on another host cannot "
                    "be checked from here. Use another directory, or, once that job has ended, "
                    "delete the lock file"
                )
            if alive:
                raise CheckpointDirectoryLockedError(
                    f"checkpoint directory {self.directory} is in use by another writer: "
                    f"{holder.describe()} (lock file {self.path}). One job writes a directory at "
                    "a time: use another directory, or stop that job first"
                )
        self._take_over(holder)

    def _take_over(self, dead: Holder | None) -> None:
        stale = self.path.with_name(f"{LOCK_NAME}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, stale)
        except FileNotFoundError:
            return  # another process took it over first: look again
        moved = _read_holder(stale)
        if dead is not None and (moved is None or moved.token != dead.token):
            try:  # not the dead holder's lock after all (replaced meanwhile): put it back
                os.link(stale, self.path)
            except OSError:
                pass
        try:
            os.unlink(stale)
        except OSError:
            pass

    def owns(self) -> bool:
        holder = _read_holder(self.path)
        return holder is not None and holder.token == self.token

    def check(self) -> None:
        """Before each write: the lock is still this writer's."""
        if self.owns():
            return
        holder = _read_holder(self.path)
        self.held = False
        who = holder.describe() if holder is not None else "nobody (the lock file is gone)"
        raise CheckpointDirectoryLockedError(
            f"checkpoint directory {self.directory}: this writer (pid {self.pid}) no longer holds "
            f"{self.path}; it is held by {who}. Was the lock file deleted while this job ran?"
        )

    def release(self) -> None:
        """Give the directory up (only this process's own lock file is removed)."""
        if not self.held or os.getpid() != self.pid:
            return
        self.held = False
        if self.owns():
            try:
                os.unlink(self.path)
            except OSError:
                pass


def remove_checkpoint(path: Path, step: int) -> None:
    """Delete a committed checkpoint so that no half-deleted one is ever seen: first renamed out
    of the listing (one rename) to a name of this writer's, then removed. A writer stopped in
    between leaves a ``.del-ckpt-...`` directory, which the next writer removes."""
    doomed = path.with_name(f".del-ckpt-{step}+{writer_tag()}+{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def replace_directory(staged: Path, target: Path) -> None:
    """Put the staged checkpoint directory at ``target`` (a save to an exact path): one already
    there is moved aside first (one rename), then the staged one renamed in, then the old one
    removed, so ``target`` always holds a whole checkpoint."""
    old = None
    if target.exists():
        old = target.with_name(f".old-{target.name}-{os.getpid()}")
        os.rename(target, old)
    os.rename(staged, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clean_leftovers(directory: Path) -> list[str]:
    """Remove the temporary and set-aside directories of writers of this host that are dead
    (or of this process, when it is not writing); returns what was removed or recovered."""
    done: list[str] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return done
    host = _host()
    for p in entries:
        m = _LEFTOVER.match(p.name)
        if m is None:
            continue
        kind, step, their_host, pid = m.group(1), m.group(2), m.group(3), int(m.group(4))
        if their_host != host or (pid != os.getpid() and pid_alive(pid)):
            continue  # a live writer's (or another host's, which cannot be checked)
        if pid == os.getpid():
            continue  # this process's own are removed by the write that made them
        final = directory / f"ckpt-{step}"
        try:
            if kind == "old" and not final.exists():
                os.rename(p, final)  # the replacement never landed: the old checkpoint is back
                done.append(f"recovered {final.name}")
                continue
            shutil.rmtree(p)
            done.append(f"removed {p.name}")
        except OSError:
            pass
    return done
