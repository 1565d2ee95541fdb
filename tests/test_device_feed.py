"""The device feed: batches handed over in order, read ahead, and a position that resumes exactly.

On CPU the feed runs its bookkeeping without copies; tests/test_gpu.py runs it with CUDA streams.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import stratagem as sg
from stratagem.data import Dataset
from stratagem.distribute.engines.device_feed import DeviceFeed, feeds


def _values(it, n=None):
    return [b.tolist() for b in itertools.islice(it, n)]


@pytest.mark.parametrize("depth", [1, 3])
def test_feed_reads_ahead_and_resumes_exactly(depth):
    ds = Dataset.range(23).shuffle(8, seed=1).batch(4)
    whole = _values(ds.iterator(epoch=0))
    feed = DeviceFeed(ds.iterator(epoch=0), torch.device("cpu"), depth)
    head = _values(feed, 2)
    assert len(feed._queue) == depth  # it read ahead: depth batches in flight
    state = feed.state_dict()
    rest = _values(DeviceFeed(ds.iterator_from_state(state), torch.device("cpu"), depth))
    assert head + rest == whole
    again = DeviceFeed(ds.iterator(epoch=0), torch.device("cpu"), depth)
    again.load_state_dict(state)
    assert _values(again) == rest


def test_input_options_and_when_the_feed_applies():
    assert not feeds(torch.device("cpu"), None)
    assert feeds(torch.device("cuda", 0), None)
    assert not feeds(torch.device("cuda", 0), sg.InputOptions(experimental_fetch_to_device=False))
    with pytest.raises(ValueError, match="buffer_size must be >= 1"):
        sg.InputOptions(experimental_per_replica_buffer_size=0)
    with pytest.raises(ValueError, match="not supported"):
        sg.InputOptions(experimental_place_dataset_on_device=True)
    s = sg.OneDeviceStrategy("cpu")  # CPU strategies are unchanged by the options
    out = [b.tolist() for b in s.experimental_distribute_dataset(Dataset.range(5).batch(2), sg.InputOptions())]
    assert out == [[0, 1], [2, 3], [4]]
