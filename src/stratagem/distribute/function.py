"""stratagem.function: graph mode for a step function, over torch.compile (tf.function's role)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class Function:
    """A step function compiled on first call with ``torch.compile``; called like the original."""

    def __init__(self, fn: Callable[..., Any], **compile_kwargs: Any) -> None:
        self.python_function = fn
        self.compile_kwargs = compile_kwargs
        self._compiled: Callable[..., Any] | None = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            import torch

            from stratagem.comm.eager import disable_for_compiler

            disable_for_compiler()  # collectives run eagerly between compiled regions
            self._compiled = torch.compile(self.python_function, **self.compile_kwargs)
        return self._compiled(*args, **kwargs)

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
    Collectives inside the step (``all_reduce``, ``compute_average_loss``) run eagerly between
    compiled regions.
    """
    kwargs: dict[str, Any] = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
    if mode is not None:
        kwargs["mode"] = mode

    def wrap(f: Callable[..., Any]) -> Function:
        return Function(f, **kwargs)

    return wrap(fn) if fn is not None else wrap
