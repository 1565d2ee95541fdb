"""Into the device: batches copied to the replica's GPU ahead of need, overlapping compute.

``DeviceFeed`` wraps an iterator of host batches. It keeps ``depth`` batches in flight: each is
copied into pinned memory and sent to the GPU with ``non_blocking`` copies on a side CUDA
stream, and an event marks when it has arrived; ``next()`` makes the compute stream wait for that
event (no host sync) and hands the batch over. The position it reports is the one before the
next batch not yet handed over, so a checkpoint resumes exactly even though it reads ahead. On a
CPU device the same bookkeeping runs with no copies (the tests exercise it there). Another
device's engine passes its own ``place`` (an XLA engine: transfer and shard the global batch).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from stratagem.core import tree
from stratagem.core.eager import eager_only


class DeviceFeed:
    """An iterator over ``source``'s batches, placed on ``device`` ``depth`` batches ahead."""

    def __init__(
        self,
        source: Iterator[Any],
        device: torch.device,
        depth: int = 1,
        place: Callable[[Any], Any] | None = None,
    ) -> None:
        self.source = source
        self.device = device
        self.depth = max(int(depth), 1)
        self.place = place
        self.cuda = device.type == "cuda" and place is None
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._queue: collections.deque[tuple[Any, Any, Any]] = collections.deque()
        self._done = False

    def __iter__(self) -> DeviceFeed:
        return self

    def get_next(self) -> Any:
        """tf's ``iterator.get_next()``: OutOfRangeError at the end."""
        from stratagem.data.iterator import get_next

        return get_next(self)

    def get_next_as_optional(self) -> Any:
        """tf's ``iterator.get_next_as_optional()``."""
        from stratagem.data.iterator import get_next_as_optional

        return get_next_as_optional(self)

    @property
    def element_spec(self) -> Any:
        return self.source.element_spec  # type: ignore[attr-defined]

    def _position(self) -> Any:
        if not hasattr(self.source, "state_dict"):
            return None
        try:
            return self.source.state_dict()
        except TypeError:  # a source that cannot save its position (a list): asked only on save
            return None

    def _fetch(self) -> None:
        position = self._position()
        try:
            batch = next(self.source)
        except StopIteration:
            self._done = True
            return
        event = None
        if self.cuda:
            with torch.cuda.stream(self.stream):
                batch = tree.map_structure(self._send, batch)
                event = torch.cuda.Event()
                event.record(self.stream)
        elif self.place is not None:
            batch = self.place(batch)
        self._queue.append((position, batch, event))

    def _send(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def __next__(self) -> Any:
        while len(self._queue) <= self.depth and not self._done:
            self._fetch()
        if not self._queue:
            raise StopIteration
        _, batch, event = self._queue.popleft()
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in tree.leaves(batch):
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    t.record_stream(current)  # the allocator must not reuse it before compute ends
        return batch

    def agree_first(self, facts: Any) -> None:
        """The distributed iterator it feeds from compares ``facts`` in its first vote."""
        agree = getattr(self.source, "agree_first", None)
        if agree is not None:
            agree(facts)

    def state_dict(self) -> dict[str, Any]:
        """The position before the next batch not yet handed over."""
        if self._queue:
            position = self._queue[0][0]
        else:
            position = self._position()
        if position is None:
            raise TypeError(f"{type(self.source).__name__} cannot save its position")
        return position  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._queue.clear()
        self._done = False
        self.source.load_state_dict(state)  # type: ignore[attr-defined]


class DeviceFedDataset:
    """A distributed dataset whose iterators are DeviceFeeds (same ``iterator(epoch)`` protocol)."""

    def __init__(
        self, inner: Any, device: torch.device, depth: int, place: Callable[[Any], Any] | None = None
    ) -> None:
        self.inner = inner
        self.device = device
        self.depth = depth
        self.place = place

    @property
    def resumable(self) -> bool:
        return bool(self.inner.resumable)

    @property
    def element_spec(self) -> Any:
        """The distributed dataset's per-replica spec (tf's ``element_spec``)."""
        return self.inner.element_spec

    def cardinality(self) -> int:
        """The distributed dataset's batches per pass (its ``cardinality()``)."""
        return int(self.inner.cardinality())

    def __iter__(self) -> DeviceFeed:
        return DeviceFeed(iter(self.inner), self.device, self.depth, self.place)

    def iterator(self, epoch: int | None = None, seed: int | None = None) -> DeviceFeed:
        return DeviceFeed(self.inner.iterator(epoch, seed), self.device, self.depth, self.place)

    def iterator_from_state(self, state: dict[str, Any]) -> DeviceFeed:
        return DeviceFeed(self.inner.iterator_from_state(state), self.device, self.depth, self.place)


def feeds(device: torch.device | None, options: Any) -> bool:
    """Whether batches for ``device`` are fed ahead: a GPU, and ``options`` do not say no."""
    if device is None or device.type != "cuda":
        return False
    return options is None or bool(getattr(options, "experimental_fetch_to_device", True))


def feed(dataset: Iterable[Any], device: torch.device | None, options: Any) -> Any:
    """``dataset`` fed to ``device`` ahead of need when ``feeds(device, options)``."""
    if not feeds(device, options):
        return dataset
    assert device is not None
    depth = getattr(options, "experimental_per_replica_buffer_size", 1) if options is not None else 1
    return DeviceFedDataset(dataset, device, depth)


eager_only(DeviceFeed, ["__next__"])
eager_only(DeviceFedDataset, ["__iter__"])  # taken eagerly inside a compiled step (see input.py)
