"""A map function's error under auto-sharding names the element's position in the dataset as
written, not within one replica's share of it (issue 53)."""

from __future__ import annotations

import pytest

from stratagem.data import Dataset, MapFunctionError
from stratagem.data.rebatch import RebatchShardDataset
from stratagem.data.sharding import rebatch_and_shard, renumbered


def _fails_on(bad: int):
    def check(x):
        if int(x) == bad:
            raise ValueError(f"bad element {int(x)}")
        return x

    return check


def _first_error(dataset):
    with pytest.raises(MapFunctionError) as info:
        for _ in dataset:
            pass
    return info.value


@pytest.mark.parametrize("bad, length", [(11, 16), (13, 16), (17, 19), (2, 19)])
def test_the_error_of_a_replicas_share_numbers_the_element_within_the_dataset(bad, length):
    dataset = Dataset.range(length).map(_fails_on(bad)).batch(8)
    owner = next(r for r in range(2) if bad in [int(v) for b in rebatch_and_shard(Dataset.range(length).batch(8), 2, r) for v in b])
    share = rebatch_and_shard(dataset, 2, owner)
    error = _first_error(share)
    assert error.position != bad or bad < 4  # within the share, another number
    better = renumbered(share, error)
    assert better is not None
    assert f"map function failed on element {bad} of the dataset (element {error.position} of replica {owner}'s share" in str(better)
    assert "ValueError: bad element" in str(better) and isinstance(better.__cause__, ValueError)


def test_positions_of_a_share_map_back_to_the_dataset_exactly():
    for length in (16, 19, 21):
        for r in range(2):
            node = RebatchShardDataset(Dataset.range(length), 8, 2, r)
            got = [int(v) for v in node]
            assert [node.source_position(k) for k in range(len(got))] == got


def test_unknown_length_and_other_maps_are_left_as_they_are():
    node = RebatchShardDataset(Dataset.range(19).filter(lambda x: x >= 0), 8, 2, 1)
    assert node.source_position(0) is None  # the length is unknown: could be the partial group
    plain = Dataset.range(8).map(_fails_on(3))
    assert renumbered(plain, _first_error(plain)) is None  # not sharded
