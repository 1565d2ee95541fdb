"""ignore_errors: drop the elements whose computation raised, and go on with the next ones."""

from __future__ import annotations

import logging
from typing import Any

from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import UNKNOWN_CARDINALITY

log = logging.getLogger(__name__)

MAX_CONSECUTIVE = 10_000
"""Consecutive errors without an element after which the input is taken to be stuck."""


class _Failed:
    """What a guarded parallel map returns for an element whose function raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Guarded:
    """``fn`` that returns a :class:`_Failed` instead of raising (picklable if ``fn`` is)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.fn(*args, **kwargs)
        except Exception as e:
            return _Failed(e)


def _not_failed(*x: Any) -> bool:
    return not (len(x) == 1 and isinstance(x[0], _Failed))


def _guard(ds: Dataset) -> Dataset:
    """The plan with every parallel map's function guarded and its failures filtered out
    right after it: a parallel map stops its workers when its function raises, so its errors
    are turned into dropped elements where they happen."""
    from stratagem.data.parallel import ParallelMapDataset

    inputs = tuple(_guard(i) for i in ds._inputs)
    if any(a is not b for a, b in zip(inputs, ds._inputs)):
        ds = ds._with_inputs(inputs)
    if isinstance(ds, ParallelMapDataset):
        mapped = ds._inputs[0].map(
            _Guarded(ds._fn), ds._n, ds._deterministic, with_rng=ds._with_rng, seed=ds._seed,
            use_processes=ds._use_processes, name=ds._name,
        )
        return mapped.filter(_not_failed)
    return ds


class IgnoreErrorsDataset(Dataset):
    """``ignore_errors(log_warning=False)``: an element whose computation raised (in a map,
    a parser, a source) is dropped and iteration continues, as tf.data does. Sources that
    cannot continue after an error end instead (``StopIteration``)."""

    def __init__(self, input_ds: Dataset, log_warning: bool = False) -> None:
        self._inputs = (_guard(input_ds),)
        self._log = bool(log_warning)

    def _cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _spec(self) -> Any:
        from stratagem.data.spec import static_spec

        return static_spec(self._inputs[0])

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _IgnoreErrorsIterator(self._inputs[0]._make_iterator(ctx.child(0)), self._log)


class _IgnoreErrorsIterator(StatefulIterator):
    def __init__(self, child: StatefulIterator, log_warning: bool) -> None:
        self.child, self.children, self.log_warning = child, [child], log_warning
        self.ignored = 0

    def __next__(self) -> Any:
        for _ in range(MAX_CONSECUTIVE):
            try:
                return next(self.child)
            except StopIteration:
                raise
            except Exception as e:
                self.ignored += 1
                if self.log_warning:
                    log.warning("ignore_errors: dropped an element: %s: %s", type(e).__name__, e)
        raise RuntimeError(
            f"ignore_errors: the input raised {MAX_CONSECUTIVE} errors in a row without "
            "producing an element; it cannot make progress"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"input": self.child.state_dict(), "ignored": self.ignored}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.child.load_state_dict(state["input"])
        self.ignored = int(state["ignored"])
