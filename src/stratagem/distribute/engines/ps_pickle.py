"""Functions shipped to workers: pickled by value (cloudpickle, so functions of ``__main__`` and
lambdas travel), with the objects a worker has its own of (variables, optimizers, the strategy,
per-worker iterators) written as handles the worker resolves to its own."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any


def _cloudpickle() -> Any:
    try:
        import cloudpickle
    except ImportError as e:  # pragma: no cover - a dependency of the "ps" extra
        raise ImportError(
            "ParameterServerStrategy ships functions to workers with cloudpickle: "
            "pip install 'stratagem[ps]' (or cloudpickle)"
        ) from e
    return cloudpickle


def dumps(obj: Any, handle_of: Callable[[Any], tuple[Any, ...] | None]) -> bytes:
    """``obj`` as bytes, each object ``handle_of`` names written as that handle."""
    cp = _cloudpickle()

    class _Pickler(cp.Pickler):  # type: ignore[misc, name-defined]
        def persistent_id(self, o: Any) -> Any:
            return handle_of(o)

    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads(data: bytes, resolve: Callable[[tuple[Any, ...]], Any]) -> Any:
    """The object ``dumps`` wrote, each handle replaced by ``resolve(handle)``."""

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return resolve(pid)

    return _Unpickler(io.BytesIO(data)).load()
