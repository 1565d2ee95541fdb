"""stratagem.function: graph mode for a step function, over torch.compile (tf.function's role)."""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("stratagem.function")

#: tf.function's rule for its retracing warning: 5 of the last 10 calls traced again
FREQUENT_RECOMPILES = 5
RECOMPILE_HISTORY = 10

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
    """A step function compiled on first call with ``torch.compile``; called like the original.

    Compiled once per input signature; a partial last batch recompiles once, into a graph whose
    batch dimension is dynamic (dynamo's automatic dynamic shapes), which later epochs reuse; no
    input is marked dynamic up front (marking it changes how torch.compile initializes lazy
    modules while tracing, differently with and without a strategy's hooks). When dynamo compiles
    any frame of the step again, one line at INFO (logger ``stratagem.function``) names the frame
    and the guard that failed, the cause; ``recompilations`` counts them. Recompiling on 5 of the
    last 10 calls is a WARNING once, with the latest cause (tf.function's retracing warning).
    """

    def __init__(self, fn: Callable[..., Any], **compile_kwargs: Any) -> None:
        self.python_function = fn
        self.compile_kwargs = compile_kwargs
        self._compiled: Callable[..., Any] | None = None
        self.recompilations = 0
        self._recent: collections.deque[bool] = collections.deque(maxlen=RECOMPILE_HISTORY)
        self._warned = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
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
        return out

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self.__call__, obj)

    def __repr__(self) -> str:
        return f"stratagem.function({getattr(self.python_function, '__qualname__', self.python_function)!r})"


def function(
    fn: Callable[..., Any] | None = None,
    *,
    backend: str = "inductor",
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
) -> Any:
    """Compile ``fn`` (a step: forward, loss, backward, update) with ``torch.compile``.

    Use as ``@stratagem.function`` or ``stratagem.function(step, backend="aot_eager")``; pass the
    result to ``strategy.run`` as you would the eager function: results are the same.
    Collectives inside the step (``all_reduce``, ``compute_average_loss``) and the gradient
    reducer's hooks run eagerly between compiled regions, so the step compiles once per input
    signature; a recompilation is logged with its cause (logger ``stratagem.function``).
    """
    kwargs: dict[str, Any] = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
    if mode is not None:
        kwargs["mode"] = mode

    def wrap(f: Callable[..., Any]) -> Function:
        return Function(f, **kwargs)

    return wrap(fn) if fn is not None else wrap
