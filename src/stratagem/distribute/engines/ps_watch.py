"""Who is still there in a ParameterServerStrategy cluster.

Every task (chief, workers, ps tasks) runs one ``ClusterWatch``: threads with their own connection
to the chief's TCPStore, so that neither rpc traffic nor a function running on the task can starve
them (one talks to the store, one looks at pids, which a stalled store call cannot hold up). It
beats (a counter in the store, every ``beat`` seconds, ``BEAT_SECONDS`` by default) and watches
the tasks it must act on: the chief watches every worker and ps task, the others watch the chief. A task is lost when

- it is on this host (same ``host_identity``) and its process is gone or stopped (SIGSTOP):
  seen within a beat;
- its heartbeat stopped for ``silent_after`` seconds (``SILENT_AFTER_SECONDS`` by default;
  ``ParameterServerStrategy(failure=FailureOptions(...))`` sets both): another host that
  vanished or is cut off;
- (the chief, watched by the others) its store does not answer for ``silent_after``, or
  refuses the connection, or it wrote that it failed (``end``: its program raised).

``on_loss`` is called once per lost process (a worker restarted under the same name is a new
process: its record in the store names a new nonce). What a loss means is the caller's: the
chief goes on without a lost worker and ends on a lost ps task; a task leaves when the chief is
lost. Keys live under ``stratagem/ps/`` in the chief's store.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from stratagem.comm.failure import host_identity
from stratagem.core.procs import pid_alive, pid_stopped

#: seconds between beats, and between looks at the watched tasks
BEAT_SECONDS = 0.25
#: a task on another host that sent no heartbeat (or a store that did not answer) for this long is lost
SILENT_AFTER_SECONDS = 6.0
PREFIX = "stratagem/ps"


@dataclass(frozen=True)
class Loss:
    """A lost task: its rpc name (``worker:1``) and what was observed, in words;
    ``stopped_pid``: its process, on this host and stopped (the caller may end it)."""

    task: str
    why: str
    stopped_pid: int | None = None


class _Seen:
    """What this watch knows of one watched task's current process."""

    def __init__(self, raw: bytes) -> None:
        info = json.loads(raw)
        self.raw = raw
        self.pid = int(info["pid"])
        self.local = info["host"] == host_identity()
        self.beats = -1
        self.changed = time.monotonic()
        self.reported = False


class ClusterWatch:
    """Beat in the chief's store at ``host:port`` as ``me`` and watch ``watched()`` (see the
    module's docstring); ``on_loss`` runs on the watch's thread."""

    def __init__(
        self,
        host: str,
        port: int,
        me: str,
        watched: Callable[[], list[str]],
        on_loss: Callable[[Loss], None],
        *,
        nonce: str,
        silent_after: float = SILENT_AFTER_SECONDS,
        beat: float = BEAT_SECONDS,
    ) -> None:
        if not 0 < beat < silent_after:
            raise ValueError(f"ClusterWatch: need 0 < beat < silent_after, got {beat} and {silent_after}")
        self.host, self.port, self.me = host, port, me
        self.beat = beat
        self.watched = watched
        self.on_loss = on_loss
        self.nonce = nonce
        self.silent_after = silent_after
        self._seen: dict[str, _Seen] = {}
        self._stop = threading.Event()
        self._last_ok = time.monotonic()
        self._chief_lost = False
        self._lock = threading.Lock()
        self._store: Any = None
        self._thread = threading.Thread(
            target=self._loop, name=f"stratagem-ps-watch-{me}", daemon=True
        )
        self._here = threading.Thread(
            target=self._watch_here, name=f"stratagem-ps-here-{me}", daemon=True
        )

    # --- the store --------------------------------------------------------------------------
    def _connect(self) -> Any:
        from torch.distributed import TCPStore

        return TCPStore(
            self.host, self.port, is_master=False, timeout=timedelta(seconds=self.silent_after),
            wait_for_workers=False,
        )  # fmt: skip

    def start(self) -> ClusterWatch:
        self._store = self._connect()
        record = json.dumps({"pid": os.getpid(), "host": host_identity(), "nonce": self.nonce})
        self._store.set(f"{PREFIX}/who/{self.me}", record)
        self._last_ok = time.monotonic()
        self._thread.start()
        self._here.start()
        return self

    def close(self, wait: float = 2.0) -> None:
        """Stop beating and watching; return once the watch's threads are out of the store (at
        most ``wait`` seconds): a store call still in flight when its server goes (the chief's
        store at its end, a test's) makes torch's client print a warning with a C++ stack trace."""
        self._stop.set()
        for t in (self._thread, self._here):
            if t.is_alive() and t is not threading.current_thread():
                t.join(wait)

    def end(self, why: str, wait: float = 1.0) -> None:
        """This task (the chief) failed: say so to every task, and give them up to ``wait``
        seconds to read it (they leave at once; the store goes with this process)."""
        self._stop.set()
        with contextlib.suppress(Exception):
            store = self._connect()
            store.set(f"{PREFIX}/end", why)
            deadline = time.monotonic() + wait
            n = len(self.watched())
            while time.monotonic() < deadline and store.add(f"{PREFIX}/saw-end", 0) < n:
                time.sleep(0.02)

    # --- the thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        store = self._store
        while not self._stop.wait(self.beat):
            try:
                store.add(f"{PREFIX}/beat/{self.me}", 1)
                if self.me != "chief" and store.check([f"{PREFIX}/end"]):
                    why = store.get(f"{PREFIX}/end").decode()
                    store.add(f"{PREFIX}/saw-end", 1)
                    self._lose_chief(why)
                    return
                for task in self.watched():
                    self._look_at(store, task)
                self._last_ok = time.monotonic()
            except Exception as e:  # noqa: BLE001 - the store is the chief's: a task cannot reach it
                if self._stop.is_set() or self.me == "chief":
                    continue
                first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
                self._lose_chief(
                    f"its store at {self.host}:{self.port} cannot be reached ({first})"
                )
                return

    def _look_at(self, store: Any, task: str) -> None:
        key = f"{PREFIX}/who/{task}"
        if not store.check([key]):
            return
        raw = store.get(key)
        seen = self._seen.get(task)
        if seen is None or seen.raw != raw:  # a (new) process under this name
            seen = self._seen[task] = _Seen(raw)
        if seen.reported or seen.local:  # a process on this host: its pid is watched (_watch_here)
            return
        beats = store.add(f"{PREFIX}/beat/{task}", 0)
        now = time.monotonic()
        if beats != seen.beats:
            seen.beats, seen.changed = beats, now
        elif now - seen.changed > self.silent_after:
            self._report(
                task,
                seen,
                f"it sent no heartbeat for {self.silent_after:g}s (its host is cut off or gone)",
            )

    def _report(self, task: str, seen: _Seen, why: str, stopped: int | None = None) -> None:
        with self._lock:
            if seen.reported or self._stop.is_set():
                return
            seen.reported = True
        if task == "chief":
            self._lose_chief(why)
        else:
            self.on_loss(Loss(task, why, stopped))

    def _watch_here(self) -> None:
        """Without the store (a stopped chief stops its store too): the processes on this host,
        by their pids; and a store call that hangs (the chief's host cut off: no answer, no
        reset) is a loss of the chief."""
        while not self._stop.wait(self.beat):
            for task, seen in list(self._seen.items()):
                if not seen.local or seen.reported:
                    continue
                if not pid_alive(seen.pid):
                    self._report(
                        task, seen, f"its process (pid {seen.pid}) is gone: killed or crashed"
                    )
                elif pid_stopped(seen.pid):
                    self._report(
                        task,
                        seen,
                        f"its process (pid {seen.pid}) is stopped (SIGSTOP or SIGTSTP)",
                        seen.pid,
                    )
            if self.me != "chief" and time.monotonic() - self._last_ok > self.silent_after:
                self._lose_chief(
                    f"its store at {self.host}:{self.port} did not answer for {self.silent_after:g}s "
                    "(its host is cut off or gone)"
                )
                return

    def _lose_chief(self, why: str) -> None:
        with self._lock:
            if self._chief_lost or self._stop.is_set():
                return
            self._chief_lost = True
        self.on_loss(Loss("chief", why))
