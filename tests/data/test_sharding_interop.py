"""auto_shard by policy, and PyTorch interop."""

import os

import pytest
import torch
import torch.utils.data as tud

from stratagem.data import AutoShardPolicy, Dataset, Options, auto_shard, from_torch


def with_policy(ds, policy):
    o = Options()
    o.distribute.auto_shard_policy = policy
    return ds.with_options(o)


def write_files(tmp_path, n):
    for f in range(n):
        (tmp_path / f"f{f}.txt").write_text("".join(f"{f}-{i}\n" for i in range(3)))
    return str(tmp_path / "*.txt")


# (policy, reads files?, expected for worker 1 of 2)
@pytest.mark.timeout(20)
def test_file_policy_splits_files(tmp_path):
    from stratagem.data import TextLineDataset

    pattern = write_files(tmp_path, 4)
    ds = with_policy(
        Dataset.list_files(pattern, shuffle=False).interleave(TextLineDataset, cycle_length=1),
        AutoShardPolicy.FILE,
    )
    shards = [list(auto_shard(ds, 2, i)) for i in range(2)]
    assert shards[0] == ["0-0", "0-1", "0-2", "2-0", "2-1", "2-2"]
    assert shards[1] == ["1-0", "1-1", "1-2", "3-0", "3-1", "3-2"]
    files = sorted(os.path.join(tmp_path, f) for f in os.listdir(tmp_path))
    auto = Dataset.from_tensors(0).concatenate(Dataset.range(0))  # no files: AUTO -> DATA
    assert list(auto_shard(auto, 2, 1)) == []
    text = TextLineDataset(files)
    assert list(auto_shard(text, 4, 3)) == ["3-0", "3-1", "3-2"]  # AUTO picks FILE
    with pytest.raises(ValueError, match="4 files but there are 5 input workers"):
        auto_shard(with_policy(text, AutoShardPolicy.FILE), 5, 0)
    with pytest.raises(ValueError, match="no file-reading source"):
        auto_shard(with_policy(Dataset.range(4), AutoShardPolicy.FILE), 2, 0)


@pytest.mark.timeout(20)
def test_data_policy_shards_before_batch():
    ds = Dataset.range(12).map(lambda x: x * 10).batch(3).prefetch(1)
    s0, s1 = (list(auto_shard(ds, 2, i)) for i in range(2))
    assert [b.tolist() for b in s0] == [[0, 20, 40], [60, 80, 100]]
    assert [b.tolist() for b in s1] == [[10, 30, 50], [70, 90, 110]]
    assert list(auto_shard(Dataset.range(5), 2, 1)) == [1, 3]
    off = with_policy(Dataset.range(4), AutoShardPolicy.OFF)
    assert list(auto_shard(off, 2, 1)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="unseeded ShuffleDataset"):
        auto_shard(Dataset.range(8).shuffle(4).batch(2), 2, 0)
    seeded = Dataset.range(8).shuffle(4, seed=1).batch(2)
    union = sorted(x for i in range(2) for b in auto_shard(seeded, 2, i) for x in b.tolist())
    assert union == list(range(8))


class MapStyle(tud.Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return torch.tensor([i, i]), i % 2


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.timeout(20)
def test_from_torch_and_dataloader_view():
    ds = from_torch(MapStyle()).batch(2)
    xs, ys = next(iter(ds))
    assert xs.tolist() == [[0, 0], [1, 1]] and ys.tolist() == [0, 1]
    assert list(Dataset.from_torch(Stream())) == [0, 1, 2, 3]
    par = from_torch(MapStyle(), num_parallel_calls=2)
    assert [x[1] for x in par] == [0, 1, 0, 1, 0]
    loader = ds.as_dataloader()
    assert loader.batch_size == 2 and len(loader) == 3 and loader.dataset is ds
    assert sum(1 for _ in loader) == 3
