"""stratagem.function: graph mode for a step function, over torch.compile (tf.function's role)."""

from __future__ import annotations

import collections
import functools
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("stratagem.function")

#: tf.function's rule for its retracing warning: 5 of the last 10 calls traced again
FREQUENT_RECOMPILES = 5
RECOMPILE_HISTORY = 10

#: ``jit_compile=None``: seconds a function runs eagerly before it is compiled (the price of a
#: compilation on a CPU, about: rent until the rent paid equals the price, then buy), and the
#: calls timed on each side before the compiled function must prove itself faster
COMPILE_AFTER_S = float(os.environ.get("STRATAGEM_COMPILE_AFTER", "20"))
TIMED_CALLS = 5


class CompilePolicy:
    """When a ``jit_compile=None`` function compiles (pure: it is told how long calls took).

    Eager until the eager calls have taken ``compile_after`` seconds in all (a function that
    never runs that long, such as a short program's, never pays for a compilation); then
    compiled; and back to eager for good if the median of ``TIMED_CALLS`` compiled calls (after
    the first, which compiles) is not faster than the median of the last eager ones. So a run
    loses at most about ``compile_after`` seconds against compiling at once, and graph mode is
    never slower than eager for long."""

    def __init__(self, compile_after: float) -> None:
        self.compile_after = compile_after
        self.eager_seconds = 0.0
        self.eager_times: collections.deque[float] = collections.deque(maxlen=TIMED_CALLS)
        self.compiled_times: list[float] = []
        self.state = "eager"  # -> "compiled" -> "kept" or "reverted"

    def record_eager(self, seconds: float) -> None:
        self.eager_seconds += seconds
        self.eager_times.append(seconds)
        if self.state == "eager" and self.eager_seconds >= self.compile_after:
            self.state = "compiled"

    def record_compiled(self, seconds: float, compiled_now: bool) -> None:
        if self.state != "compiled" or compiled_now:  # a call that compiled is not a step's time
            return
        self.compiled_times.append(seconds)
        if len(self.compiled_times) >= TIMED_CALLS:
            faster = statistics.median(self.compiled_times) < statistics.median(self.eager_times)
            self.state = "kept" if faster else "reverted"

    @property
    def compiles(self) -> bool:
        return self.state in ("compiled", "kept")

#: dynamo's loggers that note, once per process, that it drops the profiler labels
#: (``record_function``) torch's optimizers put around ``step`` and ``zero_grad``
_PROFILER_NOTE_LOGGERS = ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch")


class _DropProfilerNotes(logging.Filter):
    """Drops dynamo's "Profiler (record) function ... will be ignored" note: a compiled step that
    calls ``optimizer.step()`` loses only a profiler label, and the user did not ask for it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Profiler record function", "Profiler function"))


_drop_profiler_notes = _DropProfilerNotes()
_profiler_note_loggers = [logging.getLogger(name) for name in _PROFILER_NOTE_LOGGERS]


def _guard_failures() -> dict[Any, int]:
    """How many recompilations dynamo has recorded so far, by code object."""
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in guard_failures.items()}


def _hint(reason: str) -> str:
    if "size mismatch" in reason or "stride mismatch" in reason:
        return "a new input shape (pad or drop the last partial batch, or pass dynamic=True)"
    if "dtype mismatch" in reason or "device mismatch" in reason:
        return "an input with a new dtype or device"
    if "grad_mode" in reason or "requires_grad" in reason:
        return "a change of grad mode or of requires_grad"
    if "___check_obj_id" in reason or "ID_MATCH" in reason or "TYPE_MATCH" in reason:
        return "a different Python object where the step read one (pass it as an argument)"
    return "a Python value the step reads changed (pass it as a tensor argument, or keep it constant)"


def recompilation_reasons(before: dict[Any, int]) -> list[str]:
    """One line per frame dynamo recompiled since ``before`` (from ``_guard_failures``)."""
    from torch._dynamo.utils import guard_failures

    lines = []
    for code, reasons in list(guard_failures.items()):
        new = reasons[before.get(code, 0) :]
        if not new:
            continue
        # one recompilation records why each cached version failed, the newest first
        first = next((ln.strip() for ln in str(new[0]).splitlines() if ln.strip()), "unknown")
        first = first.split("  #")[0].strip()  # dynamo appends the source line as a comment
        where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
        lines.append(f"{where}: {first} -- likely cause: {_hint(first)}")
    return lines


class Function:
    """A step function in graph mode: compiled with ``torch.compile``, called like the original.

    ``jit_compile=True`` compiles at the first call; ``None`` (the default) when compiling pays
    (``CompilePolicy``: eager until the function has run ``compile_after`` seconds, then
    compiled, and eager again if compiled calls are not faster); ``False`` never compiles.
    Compiled once per input signature; a partial last batch recompiles once, into a graph whose
    batch dimension is dynamic (dynamo's automatic dynamic shapes), which later epochs reuse; no
    input is marked dynamic up front (marking it changes how torch.compile initializes lazy
    modules while tracing, differently with and without a strategy's hooks). When dynamo compiles
    any frame of the step again, one line at INFO (logger ``stratagem.function``) names the frame
    and the guard that failed, the cause; ``recompilations`` counts them. Recompiling on 5 of the
    last 10 calls is a WARNING once, with the latest cause (tf.function's retracing warning).
    """

    def __init__(
        self, fn: Callable[..., Any], *, jit_compile: bool | None = True, compile_after: float | None = None,
        **compile_kwargs: Any,
    ) -> None:  # fmt: skip
        self.python_function = fn
        self.compile_kwargs = compile_kwargs
        self.jit_compile = jit_compile
        self.policy = CompilePolicy(COMPILE_AFTER_S if compile_after is None else compile_after)
        self._compiled: Callable[..., Any] | None = None
        self.recompilations = 0
        self._recent: collections.deque[bool] = collections.deque(maxlen=RECOMPILE_HISTORY)
        self._warned = False
        self._last: tuple[str, bool, float] | None = None  # the last call: eager or compiled, whether it compiled, its start
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        if self.jit_compile is True:
            return self._call_compiled(*args, **kwargs)[0]
        if self.jit_compile is False or torch.compiler.is_compiling():
            return self.python_function(*args, **kwargs)  # inside a compiled caller: traced with it
        self._time_last_call()
        if not self.policy.compiles:
            self._last = ("eager", False, time.perf_counter())
            return self.python_function(*args, **kwargs)
        first = self._compiled is None
        if first:
            log.info("%r has run %.1f s eagerly: compiling it", self, self.policy.eager_seconds)
        start = time.perf_counter()
        out, recompiled = self._call_compiled(*args, **kwargs)
        self._last = ("compiled", first or recompiled, start)
        return out

    def _time_last_call(self) -> None:
        """Tell the policy how long the last call took: from its start to this call's (the
        step's wall time with whatever the loop does between steps, alike on both sides; on a
        GPU the loop's own syncs bring the queued work into it, where timing the call alone
        would see only its launches)."""
        if self._last is None:
            return
        kind, compiled_now, start = self._last
        took = time.perf_counter() - start
        if kind == "eager":
            self.policy.record_eager(took)
            return
        self.policy.record_compiled(took, compiled_now)
        if self.policy.state == "reverted":
            self._last = None
            log.info(
                "%r runs eagerly again: compiled calls took %.2f ms (median), eager ones %.2f ms",
                self, 1e3 * statistics.median(self.policy.compiled_times), 1e3 * statistics.median(self.policy.eager_times),
            )  # fmt: skip

    def _call_compiled(self, *args: Any, **kwargs: Any) -> tuple[Any, bool]:
        if self._compiled is None:
            import torch

            from stratagem.core.eager import disable_for_compiler

            disable_for_compiler()  # collectives and gradient hooks run eagerly
            self._compiled = torch.compile(self.python_function, **self.compile_kwargs)
        before = _guard_failures()
        for lg in _profiler_note_loggers:
            lg.addFilter(_drop_profiler_notes)
        try:
            out = self._compiled(*args, **kwargs)
        finally:
            for lg in _profiler_note_loggers:
                lg.removeFilter(_drop_profiler_notes)
        lines = recompilation_reasons(before) if _guard_failures() != before else []
        for line in lines:
            self.recompilations += 1
            log.info("%r recompiled %s", self, line)
        self._recent.append(bool(lines))
        if not self._warned and sum(self._recent) >= FREQUENT_RECOMPILES:
            self._warned = True
            log.warning(
                "%d of the last %d calls to %r recompiled it; compiling is expensive. The latest: %s. "
                "Usual causes: a new shape or dtype each call, a Python value the step reads that "
                "changes (pass it as a tensor argument), or a new stratagem.function made in a loop",
                sum(self._recent), len(self._recent), self, lines[-1] if lines else "?",
            )  # fmt: skip
        return out, bool(lines)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self.__call__, obj)

    def __repr__(self) -> str:
        return f"stratagem.function({getattr(self.python_function, '__qualname__', self.python_function)!r})"


def function(
    fn: Callable[..., Any] | None = None,
    *,
    jit_compile: bool | None = None,
    backend: str = "inductor",
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    compile_after: float | None = None,
) -> Any:
    """Graph mode for ``fn`` (a step: forward, loss, backward, update), over ``torch.compile``.

    Use as ``@stratagem.function`` or ``stratagem.function(step, jit_compile=True)``; pass the
    result to ``strategy.run`` as you would the eager function: results are the same.
    ``jit_compile`` as tf.function takes it: ``True`` compiles at the first call (torch.compile's
    way; XLA's under tf); ``None`` (default) compiles once compiling pays: the function runs
    eagerly until it has run ``compile_after`` seconds (default 20, or ``STRATAGEM_COMPILE_AFTER``),
    then compiled, and eagerly again if its compiled calls are not faster than its eager ones
    (both logged at INFO), so graph mode is never slower than eager for long and a short program
    never pays for a compilation; ``False`` runs eagerly. Collectives inside the step
    (``all_reduce``, ``compute_average_loss``) and the gradient reducer's hooks run eagerly
    between compiled regions, so the step compiles once per input signature; a recompilation is
    logged with its cause (logger ``stratagem.function``).
    """
    if jit_compile not in (True, False, None):
        raise ValueError(f"jit_compile must be True, False or None, got {jit_compile!r}")
    kwargs: dict[str, Any] = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
    if mode is not None:
        kwargs["mode"] = mode

    def wrap(f: Callable[..., Any]) -> Function:
        return Function(f, jit_compile=jit_compile, compile_after=compile_after, **kwargs)

    return wrap(fn) if fn is not None else wrap
