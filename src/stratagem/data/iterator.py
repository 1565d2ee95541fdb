"""Iterator runtime: the per-iterator Context, the inner iterator protocol and the public iterator."""

from __future__ import annotations

import dataclasses
import secrets
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

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
        self._finalizer = weakref.finalize(self, _close_root, self._holder)
        self._final_state: dict[str, Any] | None = None
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
        self._build(int(state["epoch"]), int(state["seed"]))
        root = self._holder[0]
        assert root is not None
        root.load_state_dict(state["root"])

    def close(self) -> None:
        """Stop the pipeline's threads and processes (idempotent)."""
        _close_root(self._holder)

    def __enter__(self) -> DatasetIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
