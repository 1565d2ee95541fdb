"""Ctrl-C that finalizers cannot swallow.

Python prints and ignores any exception raised inside a ``weakref.finalize`` callback or a
``__del__``. A SIGINT whose KeyboardInterrupt is raised while one runs (in the main thread, e.g.
when a batch viewing shared memory is garbage collected, which a loop over a dataset does every
step) is lost, and the script goes on running: a silent hang from the user's point of view.

``install_interrupt_handler()`` replaces Python's default SIGINT handler (only that one, only
from the main thread) by one that behaves the same except inside a finalizer: there it raises
nothing and delivers the interrupt again a moment later, once the finalizer has returned.
``interrupt_safe`` wraps a finalizer so that a KeyboardInterrupt raised inside it anyway (by a
handler of the user's) is re-delivered the same way.

Not every callback Python runs while ignoring its exceptions can be told from its frames: a plain
``weakref.ref`` callback (``multiprocessing.util.Finalize``, the process pool's wake-up on
collection), a generator closed by the collector. An interrupt raised in one of those reaches
``sys.unraisablehook`` instead of the program; ``install_interrupt_handler`` also wraps that hook,
so such an interrupt is delivered again too (and nothing is printed for it). Without this a Ctrl-C
that landed there did nothing, and the program ran on.
"""

from __future__ import annotations

import _thread
import functools
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

#: Seconds before an interrupt that arrived inside a finalizer is delivered again.
REDELIVER_AFTER = 0.01

_FINALIZER_CODES = {weakref.finalize.__call__.__code__}


def _redeliver_later() -> None:
    try:
        timer = threading.Timer(REDELIVER_AFTER, _thread.interrupt_main)
        timer.daemon = True
        timer.start()
    except RuntimeError:  # interpreter shutdown: it is exiting anyway
        pass


def _in_finalizer(frame: FrameType | None) -> bool:
    while frame is not None:
        code = frame.f_code
        if code in _FINALIZER_CODES or code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


#: how many times the handler has run (in the main thread: Python code was running there)
_runs = [0]


def handles_interrupts() -> bool:
    """Whether SIGINT goes to this module's handler (not a handler of the user's)."""
    try:
        return signal.getsignal(signal.SIGINT) is _handler
    except ValueError:
        return False


def handler_runs() -> int:
    """How many times the SIGINT handler has run (in the main thread). A SIGINT that arrived but
    has not been handled for a while means that the main thread is blocked in a call that does not
    return to Python (a collective, a C++ wait). A count, not a time: the handler may run before
    another thread learns that the signal arrived."""
    return _runs[0]


def _handler(signum: int, frame: FrameType | None) -> None:
    _runs[0] += 1
    if _in_finalizer(frame):
        _redeliver_later()
        return
    raise KeyboardInterrupt


def _unraisable_hook(previous: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def hook(unraisable: Any) -> Any:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _redeliver_later()  # swallowed where Python ignores exceptions: deliver it again
            return None
        return previous(unraisable)

    hook.stratagem_redelivers = True  # type: ignore[attr-defined]
    return hook


def install_interrupt_handler() -> None:
    """Make Ctrl-C survive finalizers (see the module's docstring). Idempotent; leaves a
    handler the user installed alone; does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _handler)
    except ValueError:  # e.g. an embedded interpreter without signals
        return
    if signal.getsignal(signal.SIGINT) is _handler and not getattr(sys.unraisablehook, "stratagem_redelivers", False):
        sys.unraisablehook = _unraisable_hook(sys.unraisablehook)


def interrupt_safe(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for use as a finalizer: a KeyboardInterrupt raised while it runs is re-delivered."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            # called here, interrupt_main would raise it at once, inside this finalizer again
            _redeliver_later()
            return None

    _FINALIZER_CODES.add(call.__code__)
    return functools.update_wrapper(call, fn)
