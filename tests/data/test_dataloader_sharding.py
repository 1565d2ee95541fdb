"""A torch DataLoader under MirroredStrategy(2): sharded per replica, seeded per job, resumable.

Each replica fetches only its share of every global batch (counted in the dataset's
``__getitem__``), an unseeded ``shuffle=True`` draws one order per epoch on every replica, and
the result is one process's on the same global batches."""

from __future__ import annotations

import pytest
import torch
import torch.utils.data as tud
from loader_workers import Counted, Stream, main_worker, more_worker

from stratagem.comm.communicator import LocalCommunicator
from stratagem.distribute.engines.loader import ShardedLoader, shards
from stratagem.testing import run_workers
from stratagem.train.inputs import GlobalBatches


def _same(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


@pytest.fixture(scope="module")
def main():
    return [r.value for r in run_workers(main_worker, 2, timeout=150)]


@pytest.fixture(scope="module")
def more(tmp_path_factory):
    return [
        r.value
        for r in run_workers(
            more_worker, 2, args=(str(tmp_path_factory.mktemp("backup")),), timeout=200
        )
    ]


@pytest.mark.timeout(180)
def test_fit_over_an_unseeded_loader_reads_half_on_each_replica_and_matches_one_process(main):
    r0, r1 = main
    for r in (r0, r1):
        u = r["unseeded"]
        assert u["counts"] == [100, 100]  # 200 examples a epoch: each replica fetched its half
        assert u["orders"] == r0["unseeded"]["orders"]
        for order in u["orders"]:  # every example once an epoch, in global batches of 64
            assert sorted(i for b in order for i in b) == list(range(200))
            assert [len(b) for b in order] == [64, 64, 64, 8]
        assert u["orders"][0] != u["orders"][1]  # epoch 2 reshuffled
        _same(u["params"], u["ref"])  # one process on the same global batches
    _same(r0["unseeded"]["params"], r1["unseeded"]["params"], rtol=0, atol=0)


@pytest.mark.timeout(180)
def test_a_seeded_generator_draws_the_batches_one_process_draws(main):
    for r in main:
        s = r["seeded"]
        assert s["counts"] == [100, 100]
        assert s["orders"] == s["one"]  # both epochs: one process's loader with the same generator
        assert s["orders"][0] != s["orders"][1]


@pytest.mark.timeout(180)
def test_evaluate_and_predict_over_a_loader_match_one_process(main):
    for r in main:
        # 129 examples: batches 64, 64, 1; the last leaves replica 1 a zero-size share
        assert r["evaluate"] == pytest.approx(r["evaluate_one"], rel=1e-6)
        assert r["predict"].shape == (129, 3)
        torch.testing.assert_close(r["predict"], r["predict_one"], rtol=1e-6, atol=1e-6)  # in order
        assert (
            r["predict_count"] == 65
        )  # 32 + 32 + 1 (the empty share fetches one example to shape it)


@pytest.mark.timeout(180)
def test_experimental_distribute_dataset_of_a_loader_in_a_custom_loop(main):
    r0, r1 = main
    for r in (r0, r1):
        c = r["custom"]
        assert (
            c["counts"][0] + (r1 if r is r0 else r0)["custom"]["counts"][0] == 100
        )  # batches of 15 = 8 + 7
        assert c["orders"][0] != c["orders"][1]
        for epoch in range(2):  # strategy.reduce of the replicas' shares: the global batch's sums
            want = [float(c["x"][b].sum()) for b in c["orders"][epoch]]
            assert c["sums"][epoch] == pytest.approx(want, abs=1e-4)
    assert r0["custom"]["counts"] == [53, 53] and r1["custom"]["counts"] == [47, 47]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["resume", "resume_seeded"])
def test_an_interrupted_fit_resumes_the_loader_exactly(more, kind):
    for r in more:
        d = r[kind]
        assert d["restored_from"] is not None and d["restored_from"].endswith("ckpt-6")
        _same(d["params"], d["full"], rtol=0, atol=0)
        assert d["history"] == d["full_history"]
        # after step 6 (epoch 2's second batch): epoch 2's last two shares, 32 + 4, then epoch 3's
        # 100; the skipped batches were not fetched again
        assert d["fetched"] == 136


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_iterable_dataset_loader_is_read_whole_and_split(more):
    for r in more:
        _same(r["iterable"]["params"], r["iterable"]["ref"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_replicas_drawing_different_batches_are_an_error_saying_to_seed_them(more):
    for r in more:
        assert r["mismatch"] is not None
        assert r["mismatch"].startswith(
            "ReplicaMismatchError: the dataset yielded different first global batches on different "
            "replicas (the DataLoader's sample indices: crc32 "
        )
        assert "seed any shuffling alike on every replica" in r["mismatch"]


# --- one replica's view, in this process (a communicator standing for N agreeing replicas) -----


class AsReplica(LocalCommunicator):
    """Replica ``rank`` of ``world`` replicas that all vote alike (every collective: its own value)."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world

    def all_gather_object(self, obj):
        return [obj] * self.world_size

    def broadcast_object(self, obj, src=0):
        return torch.initial_seed()  # the job seed rank 0, seeded as this process, sends


def _shares(make, world: int, passes: int = 1) -> tuple[list[list[list]], list[list[int]]]:
    """Each replica's batches (``passes`` passes) of ``make()`` and the indices it fetched."""
    batches, fetched = [], []
    for rank in range(world):
        loader = make()
        dist = ShardedLoader(loader, AsReplica(rank, world), None)
        batches.append([list(dist.iterator(epoch=p)) for p in range(passes)])
        fetched.append(list(loader.dataset.seen))
    return batches, fetched


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world", [2, 3])
def test_the_replicas_shares_in_rank_order_are_the_global_batches(world):
    def make():
        return tud.DataLoader(
            Counted(22), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)
        )

    batches, fetched = _shares(make, world, passes=2)
    alone = make()
    for p in range(2):
        for b, (x, y) in enumerate(alone):
            assert torch.equal(torch.cat([batches[r][p][b][0] for r in range(world)]), x)
            assert torch.equal(torch.cat([batches[r][p][b][1] for r in range(world)]), y)
    # 22 = 5 x 4 + 2, a pass: 4 = 2 + 1 + 1 on 3 replicas, and the last batch leaves replica 2
    # a zero-size batch, shaped after that batch's first example (the one extra it fetches)
    assert [len(f) for f in fetched] == ([22, 22] if world == 2 else [22, 12, 12])
    if world == 3:
        assert batches[2][0][-1][0].shape == (0, 5) and batches[2][0][-1][1].dtype == torch.int64


@pytest.mark.timeout(30)
def test_an_unseeded_shuffle_is_drawn_from_the_job_seed_and_the_pass():
    def order(seed: int, epoch: int) -> list[int]:
        torch.manual_seed(seed)  # rank 0's torch.initial_seed() is the job seed
        loader = tud.DataLoader(Counted(20), batch_size=4, shuffle=True)
        list(ShardedLoader(loader, AsReplica(0, 2), None).iterator(epoch=epoch))
        assert loader.sampler.generator is None  # the user's loader is left as it was
        return loader.dataset.seen

    assert order(7, 0) == order(7, 0)
    assert order(7, 0) != order(7, 1) and order(7, 0) != order(8, 0)
    assert sorted(order(7, 1)) != order(7, 1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seeded", [False, True])
def test_a_saved_position_resumes_exactly_without_fetching_the_batches_again(seeded):
    def make():
        g = torch.Generator().manual_seed(5) if seeded else None
        return tud.DataLoader(Counted(40), batch_size=6, shuffle=True, generator=g)

    torch.manual_seed(0)
    dist = ShardedLoader(make(), AsReplica(1, 2), None)
    list(dist.iterator(epoch=0))
    it = dist.iterator(epoch=1)
    head = [next(it) for _ in range(3)]
    state = it.state_dict()
    rest = list(it)
    again = list(dist.iterator(epoch=2))
    torch.manual_seed(99)  # another process: its own seed is not the job's
    loader = make()
    fresh = ShardedLoader(loader, AsReplica(1, 2), None)
    resumed = fresh.iterator_from_state(state)
    assert len(head) == 3
    for a, b in zip(list(resumed) + list(fresh.iterator(epoch=2)), rest + again, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # 40 = 6 x 6 + 4: epoch 1's last 3 shares of 3 and its last of 2, then epoch 2's 20
    assert len(loader.dataset.seen) == 3 * 3 + 2 + 20
    loaded = ShardedLoader(make(), AsReplica(1, 2), None).iterator(epoch=0)  # a Checkpoint's way
    loaded.load_state_dict(state)
    for a, b in zip(loaded, rest, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.timeout(30)
def test_a_dataset_with_getitems_as_hugging_face_datasets_has_is_read_by_its_shares():
    class Rows(
        tud.Dataset
    ):  # the protocol of a map-style datasets.Dataset: rows as dicts, fetched in bulk
        def __init__(self) -> None:
            self.asked: list[list[int]] = []

        def __len__(self) -> int:
            return 10

        def __getitems__(self, indices: list[int]) -> list[dict]:
            self.asked.append(list(indices))
            return [{"x": torch.tensor([float(i)]), "label": i % 2} for i in indices]

    loader = tud.DataLoader(Rows(), batch_size=4)
    got = list(ShardedLoader(loader, AsReplica(1, 2), None))
    assert loader.dataset.asked == [[2, 3], [6, 7], [9]]
    assert [b["x"].flatten().tolist() for b in got] == [[2.0, 3.0], [6.0, 7.0], [9.0]]
    assert got[0]["label"].tolist() == [0, 1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_with_workers_a_replica_reads_its_slice_of_what_the_loader_gives_alone(persistent):
    def make():
        g = torch.Generator().manual_seed(1)
        return tud.DataLoader(Counted(30), batch_size=8, shuffle=True, generator=g, num_workers=2,
                              persistent_workers=persistent)  # fmt: skip

    dist, alone = ShardedLoader(make(), AsReplica(1, 2), None), make()
    for epoch in range(2):  # (a persistent loader draws no new worker seed the second time)
        shares = list(dist.iterator(epoch=epoch))
        whole = list(alone)
        assert len(shares) == len(whole) == 4
        for (x, y), (gx, gy) in zip(shares, whole, strict=True):
            half = (len(gx) + 1) // 2
            assert torch.equal(x, gx[half:]) and torch.equal(y, gy[half:])


@pytest.mark.timeout(30)
def test_which_loaders_are_sharded_and_a_distributed_sampler_is_an_error():
    ds = Counted(8)
    assert shards(tud.DataLoader(ds, batch_size=4))
    assert shards(tud.DataLoader(ds, batch_sampler=[[0, 1], [2, 3]]))
    assert not shards(
        tud.DataLoader(Stream(8), batch_size=4)
    )  # iterable-style: read whole and split
    assert not shards(tud.DataLoader(ds, batch_size=None))  # its dataset's items are the batches
    sampler = tud.DistributedSampler(ds, num_replicas=2, rank=0)
    with pytest.raises(TypeError, match="DistributedSampler.*distribute_datasets_from_function"):
        ShardedLoader(tud.DataLoader(ds, batch_size=4, sampler=sampler), AsReplica(0, 2), None)


@pytest.mark.timeout(30)
def test_a_loader_position_saved_by_n_replicas_resumes_on_another_number():
    torch.manual_seed(4)
    it = ShardedLoader(Counted(40).loader(), AsReplica(0, 2), None).iterator(epoch=1)
    next(it)
    saved = {"pass": 1, "consumed": 1, "epoch_step": 1, "exhausted": False, "replayable": True,
             "iterator": it.state_dict()}  # fmt: skip
    state = GlobalBatches.reshard_state([saved, saved], world=3)
    assert state["iterator"] == saved["iterator"]  # global: pass, seed, batches (not the split)
    rest = ShardedLoader(Counted(40).loader(), AsReplica(2, 3), None).iterator_from_state(
        state["iterator"]
    )
    whole = list(ShardedLoader(Counted(40).loader(), AsReplica(0, 1), None).iterator(epoch=1))
    for (x, _), (gx, _) in zip(rest, whole[1:], strict=True):
        assert torch.equal(x, gx[-(len(gx) // 3) :])
