"""Processes of this host by pid: alive (not a zombie, not a reused pid) or stopped by a signal.
Linux (``/proc``); imports nothing but the standard library, so the launcher may use it."""

from __future__ import annotations

import os


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, to tell a reused pid (None: unknown)."""
    fields = _stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def pid_alive(pid: int, started: str | None = None) -> bool:
    """Whether process ``pid`` of this host runs (and is the one that started at ``started``):
    a zombie (dead, not yet reaped by its parent) counts as dead, and so does a pid too large to
    be one."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except OverflowError:
        return False
    fields = _stat_fields(pid)
    if fields is None:
        return True
    if fields[0] == "Z":
        return False
    return not (started is not None and len(fields) > 19 and fields[19] != started)  # reused pid


def pid_stopped(pid: int) -> bool:
    """The process is stopped by a signal (SIGSTOP, SIGTSTP; not a debugger's tracing stop)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] == "T"
