"""Iterator runtime: the per-iterator Context, the inner iterator protocol and the public iterator."""

from __future__ import annotations

import dataclasses
import secrets
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from stratagem.core.finalizers import interrupt_safe
from stratagem.data.options import Options

if TYPE_CHECKING:
    from stratagem.data.dataset import Dataset

STATE_FORMAT = "stratagem.data.iterator/1"


@dataclasses.dataclass(frozen=True)
class Context:
    """What an iterator needs to know beyond its plan: seeds, epoch, position, options."""

    seed: int
    epoch: tuple[int, ...]
    path: tuple[int, ...]
    options: Options

    def child(self, index: int) -> Context:
        return dataclasses.replace(self, path=(*self.path, index))

    def with_epoch(self, epoch: int) -> Context:
        return dataclasses.replace(self, epoch=(*self.epoch, epoch))

    def seed_sequence(self, own_seed: int | None, *extra: int) -> np.random.SeedSequence:
        """Seeds from (seed, epoch, extra...): the node's own seed, else the iterator seed + path."""
        if own_seed is not None:
            entropy = [int(own_seed) & 0xFFFFFFFFFFFFFFFF]
        else:
            entropy = [self.seed, len(self.path), *self.path]
        return np.random.SeedSequence([*entropy, len(self.epoch), *self.epoch, *extra])


class StatefulIterator:
    """Inner iterator protocol: ``__next__``, ``state_dict``, ``load_state_dict``, ``close``.

    ``load_state_dict`` is only ever called on a freshly built iterator (the public iterator
    rebuilds the whole tree before restoring), so implementations need not undo progress.
    ``state_dict`` returns new plain values (ints, strings, lists, dicts) and may be called
    after ``close``.
    """

    children: list[StatefulIterator]

    def __iter__(self) -> StatefulIterator:
        return self

    def __next__(self) -> Any:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        for child in getattr(self, "children", ()):
            child.close()


class OutOfRangeError(Exception):
    """``iterator.get_next()`` past the end (tf.errors.OutOfRangeError). A ``for`` loop and
    ``next()`` end with StopIteration as usual."""


class InvalidArgumentError(ValueError):
    """``Optional.get_value()`` of an empty Optional (tf.errors.InvalidArgumentError)."""


class Optional:
    """A value that may be absent (``tf.experimental.Optional``): what
    ``iterator.get_next_as_optional()`` returns. ``has_value()`` is a Python bool (tf: a bool
    tensor, which ``if`` reads the same way)."""

    __slots__ = ("_value", "_has", "_spec")

    def __init__(self, value: Any = None, has_value: bool = False, element_spec: Any = None
                 ) -> None:
        self._value, self._has, self._spec = value, bool(has_value), element_spec

    @staticmethod
    def from_value(value: Any) -> Optional:
        from stratagem.data.spec import spec_of
        from stratagem.data.structure import normalize

        value = normalize(value)
        return Optional(value, True, spec_of(value))

    @staticmethod
    def empty(element_spec: Any) -> Optional:
        return Optional(None, False, element_spec)

    def has_value(self) -> bool:
        return self._has

    def get_value(self) -> Any:
        if not self._has:
            raise InvalidArgumentError(
                "get_value() of an empty Optional (the iterator had ended); check has_value() "
                "first"
            )
        return self._value

    @property
    def element_spec(self) -> Any:
        return self._spec

    def __bool__(self) -> bool:
        raise TypeError(
            "the truth value of an Optional is ambiguous; use optional.has_value()"
        )

    def __repr__(self) -> str:
        return f"Optional(has_value={self._has}, element_spec={self._spec!r})"


def get_next(iterator: Any) -> Any:
    """``next(iterator)``, raising OutOfRangeError at the end as tf's ``get_next()`` does."""
    try:
        return next(iterator)
    except StopIteration:
        raise OutOfRangeError("End of sequence") from None


def get_next_as_optional(iterator: Any, element_spec: Any = None) -> Optional:
    """The next element as an Optional (empty at the end), as tf's ``get_next_as_optional``."""
    try:
        value = next(iterator)
    except StopIteration:
        return Optional.empty(element_spec)
    from stratagem.data.spec import spec_of

    try:
        spec = element_spec if element_spec is not None else spec_of(value)
    except TypeError:
        spec = None
    return Optional(value, True, spec)


def _failing_node(exc: BaseException) -> str:
    """The innermost StatefulIterator whose load_state_dict was running when exc was raised."""
    node = ""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, StatefulIterator):
            node = type(owner).__name__
        tb = tb.tb_next
    return node


def _first_difference(expected: Any, got: Any, path: str) -> str:
    """Where ``got`` first differs in structure (dict keys, kinds) from ``expected``."""
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"{path} is a {type(got).__name__}, this pipeline expects a dict"
        if set(expected) != set(got):
            lack = sorted(set(expected) - set(got), key=str)
            extra = sorted(set(got) - set(expected), key=str)
            parts = []
            if lack:
                parts.append(f"lacks key(s) {lack}")
            if extra:
                parts.append(f"has unexpected key(s) {extra}")
            return f"{path} {' and '.join(parts)}"
        for k in expected:
            d = _first_difference(expected[k], got[k], f"{path}[{k!r}]")
            if d:
                return d
        return ""
    if isinstance(expected, list):
        if not isinstance(got, list):
            return f"{path} is a {type(got).__name__}, this pipeline expects a list"
        for i, (a, b) in enumerate(zip(expected, got, strict=False)):
            d = _first_difference(a, b, f"{path}[{i}]")
            if d:
                return d
    return ""


def _close_root(holder: list[StatefulIterator | None]) -> None:
    root = holder[0]
    holder[0] = None
    if root is not None:
        root.close()


class DatasetIterator:
    """The iterator ``iter(dataset)`` returns: owns the threads/processes of its pipeline.

    ``close()``, leaving a ``with`` block, exhaustion or garbage collection shut them down.
    ``state_dict()`` is JSON-serializable; ``load_state_dict(state)`` resumes exactly.
    """

    def __init__(self, dataset: Dataset, epoch: int, seed: int | None = None) -> None:
        self._dataset = dataset
        self._options = dataset.options()
        self._holder: list[StatefulIterator | None] = [None]
        self._finalizer = weakref.finalize(self, interrupt_safe(_close_root), self._holder)
        self._final_state: dict[str, Any] | None = None
        self._spec: Any = None
        self._build(epoch, seed)

    def _build(self, epoch: int, seed: int | None) -> None:
        _close_root(self._holder)
        if seed is None:
            seed = self._options.seed
        if seed is None:
            seed = secrets.randbits(63)
        self._epoch, self._seed = int(epoch), int(seed)
        ctx = Context(seed=self._seed, epoch=(self._epoch,), path=(), options=self._options)
        self._holder[0] = self._dataset._make_iterator(ctx)
        self._final_state = None

    def __iter__(self) -> DatasetIterator:
        return self

    def __next__(self) -> Any:
        root = self._holder[0]
        if root is None:
            raise StopIteration
        try:
            return next(root)
        except StopIteration:
            self._final_state = self.state_dict()
            _close_root(self._holder)
            raise
        except BaseException:
            _close_root(self._holder)
            raise

    def get_next(self) -> Any:
        """The next element; OutOfRangeError at the end (tf's ``iterator.get_next()``)."""
        return get_next(self)

    def get_next_as_optional(self) -> Optional:
        """The next element as an :class:`Optional`, empty at the end (tf's
        ``iterator.get_next_as_optional()``)."""
        if self._spec is None:
            from stratagem.data.spec import static_spec

            self._spec = static_spec(self._dataset)
        out = get_next_as_optional(self, self._spec)
        if self._spec is None:
            self._spec = out.element_spec  # the spec of the first element
        return out

    @property
    def element_spec(self) -> Any:
        """The dataset's ``element_spec`` (tf's ``iterator.element_spec``)."""
        return self._dataset.element_spec

    def state_dict(self) -> dict[str, Any]:
        """Where this iterator stands, as plain JSON-serializable values."""
        if self._final_state is not None:
            return self._final_state
        root = self._holder[0]
        if root is None:
            raise RuntimeError("this iterator was closed before it finished; it has no state")
        return {
            "format": STATE_FORMAT,
            "epoch": self._epoch,
            "seed": str(self._seed),
            "root": root.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` of an iterator over the same pipeline."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a stratagem.data iterator state (format {got!r}, expected "
                f"{STATE_FORMAT!r}); pass the dict returned by iterator.state_dict()"
            )
        missing = [k for k in ("epoch", "seed", "root") if k not in state]
        if missing:
            raise ValueError(
                f"iterator state lacks key(s) {missing} (it has {sorted(state)}); pass the "
                "dict returned by iterator.state_dict() of an iterator over this pipeline"
            )
        self._build(int(state["epoch"]), int(state["seed"]))
        root = self._holder[0]
        assert root is not None
        try:
            root.load_state_dict(state["root"])
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            node = _failing_node(e)
            try:  # the state a fresh iterator over this pipeline has, to compare with
                self._build(self._epoch, self._seed)
                fresh = self._holder[0]
                diff = _first_difference(
                    fresh.state_dict() if fresh is not None else None,
                    state["root"],
                    "state['root']",
                )
            except Exception:
                diff = ""
            _close_root(self._holder)
            raise ValueError(
                "iterator state does not match this pipeline"
                + (f" ({diff})" if diff else "")
                + (f"; restoring {node} failed with {type(e).__name__}: {e}" if node else
                   f"; restoring failed with {type(e).__name__}: {e}")
                + "; restore a state saved from an iterator over the same pipeline "
                "(same transformations in the same order)"
            ) from e

    def close(self) -> None:
        """Stop the pipeline's threads and processes (idempotent)."""
        _close_root(self._holder)

    def __enter__(self) -> DatasetIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
