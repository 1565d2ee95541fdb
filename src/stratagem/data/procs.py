"""Pipeline worker processes: how they start (fork on Linux), live (one torch thread, a
watchdog on the parent) and are reported when the OS ends them.

On Linux workers are forked, as torch's DataLoader does: a script without an
``if __name__ == "__main__":`` guard works, the map function need not be picklable, and the
worker starts in milliseconds with torch already imported. Elsewhere (no safe fork) the
``forkserver`` (else ``spawn``) context is used, and starting a worker from a module that a
worker is importing fails at once with one line naming the fix.

Nothing a worker holds outlives the job: each worker runs a watchdog thread that exits the
process (``os._exit``) within :data:`WATCH_SECONDS` of its parent disappearing (SIGKILL,
SIGTERM, an OOM kill of the main process or the whole process group); workers ignore SIGINT
(the main process handles Ctrl-C and stops them). With the fork context, multiprocessing's
semaphores are unlinked at creation and the batch engine's shared memory is anonymous
(memfd), so no named segment or semaphore is left behind either.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from stratagem.core.finalizers import install_interrupt_handler

WATCH_SECONDS = 0.25  # how often a worker checks that its parent is alive

_context_lock = threading.Lock()
_context: multiprocessing.context.BaseContext | None = None


def process_context() -> multiprocessing.context.BaseContext:
    """fork on Linux (DataLoader's choice); forkserver, else spawn, elsewhere."""
    global _context
    with _context_lock:
        if _context is None:
            methods = multiprocessing.get_all_start_methods()
            if sys.platform.startswith("linux") and "fork" in methods:
                _context = multiprocessing.get_context("fork")
            elif "forkserver" in methods:
                _context = multiprocessing.get_context("forkserver")
            else:
                _context = multiprocessing.get_context("spawn")
        return _context


def forks() -> bool:
    """Whether workers are forked (they inherit the function and the pipeline as they are)."""
    return process_context().get_start_method() == "fork"


def check_can_start(what: str) -> None:
    """Fail before starting any worker when that cannot work: a spawned worker importing a
    script that builds the pipeline at import time (no ``__main__`` guard)."""
    if forks():
        return
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        raise RuntimeError(
            f"{what}: worker processes cannot start while a worker is importing the main "
            "script; put the script's pipeline code under `if __name__ == \"__main__\":`"
        )


def start(target: Callable[..., Any], args: tuple[Any, ...], name: str) -> Any:
    """Start one daemon worker process running ``target(*args)`` after :func:`init_worker`."""
    install_interrupt_handler()  # the batches they send are freed by finalizers: Ctrl-C must not be lost there
    ctx = process_context()
    proc = ctx.Process(  # type: ignore[attr-defined]
        target=_run, args=(os.getpid() if forks() else None, target, args), name=name,
        daemon=True,
    )
    with warnings.catch_warnings():  # Python >= 3.12 warns on fork with threads alive
        warnings.simplefilter("ignore", DeprecationWarning)
        proc.start()
    return proc


def _run(parent: int | None, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    init_worker(parent)
    target(*args)


def init_worker(parent: int | None = None) -> None:
    """Run first in every pipeline worker: one torch thread, SIGINT ignored, a watchdog."""
    torch.set_num_threads(1)  # as DataLoader workers: the workers are the parallelism
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread (cannot happen in a fresh worker)
        pass
    ppid = os.getppid() if parent is None else parent
    threading.Thread(target=_watch, args=(ppid,), name="stratagem-watchdog", daemon=True).start()


def _watch(ppid: int) -> None:
    while True:
        time.sleep(WATCH_SECONDS)
        if os.getppid() != ppid:  # re-parented: the process that started us is gone
            os._exit(1)


def describe_exit(exitcode: int | None) -> str:
    """How a worker ended, for an error message (``-9`` -> killed by SIGKILL, ...)."""
    if exitcode is None:
        return "is unresponsive"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (the kernel's out-of-memory killer sends SIGKILL)" if -exitcode == 9 else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {exitcode}"
