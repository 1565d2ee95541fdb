"""Calling user functions: argument unpacking, per-element RNG, and errors that name the element."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class MapFunctionError(ValueError):
    """A user function failed on an element; ``__cause__`` holds the original exception.
    ``position`` is the element's position in the function's input, ``what`` the transformation
    (``map``), ``fn`` the function and ``reason`` the original error in words (None when
    unknown, e.g. raised in a worker process)."""

    position: int | None = None
    what: str | None = None
    fn: Callable[..., Any] | None = None
    reason: str | None = None


def function_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def element_rng(entropy: np.random.SeedSequence | list[int]) -> np.random.Generator:
    """The numpy Generator a ``map(..., with_rng=True)`` function receives for one element.

    It is seeded from (seed, epoch, element index) only, so results do not depend on the
    number of threads or processes. For torch ops: ``torch.Generator().manual_seed(
    int(rng.integers(2**63)))``.
    """
    seq = entropy if isinstance(entropy, np.random.SeedSequence) else np.random.SeedSequence(
        entropy
    )
    return np.random.Generator(np.random.PCG64(seq))


def call(fn: Callable[..., Any], element: Any, rng: np.random.Generator | None = None) -> Any:
    """Call ``fn`` the tf.data way: a tuple element is unpacked into positional arguments."""
    kwargs = {} if rng is None else {"rng": rng}
    if isinstance(element, tuple):
        return fn(*element, **kwargs)
    return fn(element, **kwargs)


def call_checked(
    fn: Callable[..., Any],
    element: Any,
    position: int,
    what: str,
    rng: np.random.Generator | None = None,
) -> Any:
    """:func:`call`, raising MapFunctionError naming the element's position on failure."""
    try:
        return call(fn, element, rng)
    except Exception as e:
        raise failure(what, fn, position, e) from e


def failure(what: str, fn: Callable[..., Any], position: int, e: BaseException) -> MapFunctionError:
    return failure_at(what, fn, f"element {position}", position, f"{type(e).__name__}: {e}", e)


def failure_at(
    what: str, fn: Callable[..., Any], element: str, position: int, reason: str, cause: BaseException | None
) -> MapFunctionError:
    """The MapFunctionError for ``fn`` failing on ``element`` (its words: "element 7")."""
    err = MapFunctionError(f"{what} function failed on {element} of {what}({function_name(fn)}): {reason}")
    err.position, err.what, err.fn, err.reason = position, what, fn, reason
    err.__cause__ = cause
    return err
