"""A Ctrl-C raised while a finalizer runs is not swallowed (Python ignores exceptions there)."""

import gc
import signal
import sys
import time
import weakref

import pytest

from stratagem.core import finalizers
from stratagem.core.finalizers import interrupt_safe


class _Owner:
    pass


@pytest.mark.timeout(30)
def test_an_interrupt_inside_a_finalizer_reaches_the_main_thread():
    calls = []

    def on_free():
        calls.append("ran")
        raise KeyboardInterrupt  # as if SIGINT arrived while the finalizer ran

    previous = signal.getsignal(signal.SIGINT)  # Python's own handler (another test may have left SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        owner = _Owner()
        weakref.finalize(owner, interrupt_safe(on_free))
        with pytest.raises(KeyboardInterrupt):
            gc.disable()  # no other object's weakref callback may run (and swallow it) meanwhile
            del owner  # the finalizer runs here (reference count)
            for _ in range(2000):  # the re-delivered interrupt is raised here, outside the finalizer
                time.sleep(0.001)
    finally:
        gc.enable()
        signal.signal(signal.SIGINT, previous)
    assert calls == ["ran"]


def test_a_finalizer_returns_its_value_and_keeps_its_name():
    def close(x):
        return x + 1

    safe = interrupt_safe(close)
    assert safe(1) == 2 and safe.__name__ == "close"


@pytest.mark.timeout(30)
def test_the_handler_defers_an_interrupt_that_arrives_inside_a_finalizer():
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        finalizers.install_interrupt_handler()
        assert signal.getsignal(signal.SIGINT) is finalizers._handler
        ran = []

        def on_free():
            signal.raise_signal(signal.SIGINT)  # SIGINT arrives while the finalizer runs
            ran.append("finished")  # not cut short

        owner = _Owner()
        weakref.finalize(owner, on_free)
        with pytest.raises(KeyboardInterrupt):
            gc.disable()
            del owner
            for _ in range(2000):  # delivered again here, after the finalizer
                time.sleep(0.001)
        assert ran == ["finished"]
        with pytest.raises(KeyboardInterrupt):  # outside a finalizer: at once, as by default
            signal.raise_signal(signal.SIGINT)
    finally:
        gc.enable()
        signal.signal(signal.SIGINT, previous)


def test_a_handler_of_the_users_is_left_alone():
    def mine(signum, frame):
        pass

    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, mine)
    try:
        finalizers.install_interrupt_handler()
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(30)
def test_an_interrupt_swallowed_by_a_plain_weakref_callback_is_delivered_again():
    """A plain ``weakref.ref`` callback (multiprocessing's Finalize, the process pool's wake-up)
    cannot be told from its frames; Python prints and drops what it raises. A Ctrl-C landing there
    must still stop the program (this once did nothing: the job ran on after SIGINT)."""
    previous, hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        finalizers.install_interrupt_handler()
        ran = []

        def callback(ref):
            ran.append("ran")
            raise KeyboardInterrupt  # as if SIGINT arrived while the callback ran

        owner = _Owner()
        keep = weakref.ref(owner, callback)  # noqa: F841 - the callback needs the ref alive
        with pytest.raises(KeyboardInterrupt):
            gc.disable()
            del owner  # the callback runs here; Python swallows its KeyboardInterrupt
            deadline = time.monotonic() + 10.0  # delivered again here (10 ms later; more on a loaded machine)
            while time.monotonic() < deadline:
                time.sleep(0.001)
        assert ran == ["ran"]
    finally:
        gc.enable()
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook
