"""Workers for test_dataloader_sharding.py: torch DataLoaders under MirroredStrategy(2)."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.data as tud
from torch import nn

import stratagem as sg
from stratagem.core.batches import split_sizes
from stratagem.train import callbacks as C
from stratagem.train import evaluate, fit, predict


class Counted(tud.Dataset):
    """``n`` examples (x: 5 features, y: 3 classes); ``seen`` lists the indices fetched, in order."""

    def __init__(self, n: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append(int(i))
        return self.x[i], self.y[i]

    def loader(self) -> tud.DataLoader:
        """In batches of 6, shuffled without a generator."""
        return tud.DataLoader(self, batch_size=6, shuffle=True)


class Stream(tud.IterableDataset):
    """The examples of ``Counted(n)`` in order, as an iterable-style dataset."""

    def __init__(self, n: int) -> None:
        self.data = Counted(n)

    def __iter__(self) -> Any:
        return (self.data[i] for i in range(len(self.data)))


class EpochSeen(C.Callback):
    """The indices the dataset fetched in each epoch (this replica's)."""

    def __init__(self, ds: Counted) -> None:
        super().__init__()
        self.ds, self.epochs = ds, []  # type: ignore[var-annotated]

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.ds.seen.clear()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.epochs.append(list(self.ds.seen))


class Crash(C.Callback):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.state.iterations == self.at:
            raise KeyboardInterrupt("simulated interruption")


def build(strategy: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def train(strategy: Any, data: Any, **kw: Any) -> tuple[nn.Module, Any]:
    model, opt = build(strategy)
    hist = fit(model, opt, nn.CrossEntropyLoss(), data, strategy=strategy, verbose=0, **kw)
    return model, hist


def global_order(shares: list[list[int]], sizes: list[int]) -> list[list[int]]:
    """The global batches of ``sizes`` from each replica's fetched indices, in rank order."""
    out, offsets = [], [0] * len(shares)
    for size in sizes:
        batch: list[int] = []
        for r, n in enumerate(split_sizes(size, len(shares))):
            batch += shares[r][offsets[r] : offsets[r] + n]
            offsets[r] += n
        out.append(batch)
    return out


def as_batches(ds: Counted, order: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(ds.x[b], ds.y[b]) for b in order]


def main_worker() -> dict[str, Any]:
    """fit (unseeded and seeded), evaluate, predict and a custom loop over DataLoaders on 2
    replicas, with their one-process references, in one launch."""
    mirrored = sg.MirroredStrategy(devices="cpu", num_replicas=2, timeout=60)
    one = sg.OneDeviceStrategy()
    comm = mirrored.extended.comm
    out: dict[str, Any] = {"rank": mirrored.extended.replica_id}
    sizes = [64, 64, 64, 8]  # 200 examples in batches of 64

    # (a) an unseeded shuffle: each replica fetches its half; epochs reshuffle; one process's weights
    ds = Counted(200)
    seen = EpochSeen(ds)
    model, _ = train(
        mirrored, tud.DataLoader(ds, batch_size=64, shuffle=True), epochs=2, callbacks=[seen]
    )
    everyone = comm.all_gather_object(seen.epochs)
    orders = [global_order([e[epoch] for e in everyone], sizes) for epoch in range(2)]
    ref_model, _ = train(
        one, [b for order in orders for b in as_batches(ds, order)], epochs=1
    )  # both epochs' batches
    out["unseeded"] = {"counts": [len(e) for e in seen.epochs], "orders": orders,
                       "params": params_of(model), "ref": params_of(ref_model)}  # fmt: skip

    # (b) a user-seeded generator: the global batches one process's loader draws
    ds = Counted(200)
    seen = EpochSeen(ds)
    loader = tud.DataLoader(
        ds, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    train(mirrored, loader, epochs=2, callbacks=[seen])
    everyone = comm.all_gather_object(seen.epochs)
    alone = tud.DataLoader(
        torch.arange(200), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    out["seeded"] = {"orders": [global_order([e[epoch] for e in everyone], sizes) for epoch in range(2)],
                     "one": [[b.tolist() for b in alone] for _ in range(2)],
                     "counts": [len(e) for e in seen.epochs]}  # fmt: skip

    # (c) evaluate and predict (129 examples: the last global batch of 1 leaves replica 1 empty)
    ds = Counted(129, seed=2)
    loader = tud.DataLoader(ds, batch_size=64)
    m = {"metrics": ["sparse_categorical_accuracy"], "return_dict": True}
    out["evaluate"] = evaluate(model, nn.CrossEntropyLoss(), loader, strategy=mirrored, **m)
    alone = tud.DataLoader(Counted(129, seed=2), batch_size=64)
    twin, _ = build(one)  # the same weights, under one device
    twin.load_state_dict(model.state_dict())
    out["evaluate_one"] = evaluate(twin, nn.CrossEntropyLoss(), alone, strategy=one, **m)
    ds.seen.clear()
    out["predict"] = predict(model, loader, strategy=mirrored)
    out["predict_count"] = len(ds.seen)
    out["predict_one"] = predict(
        twin, tud.DataLoader(Counted(129, seed=2), batch_size=64), strategy=one
    )

    # (f) experimental_distribute_dataset in a custom loop with strategy.run
    ds = Counted(100)
    dist = mirrored.experimental_distribute_dataset(tud.DataLoader(ds, batch_size=15, shuffle=True))
    epochs = []
    for _ in range(2):
        ds.seen.clear()
        sums = [float(mirrored.reduce("sum", mirrored.run(lambda x, y: x.sum(0), args=(x, y)), axis=None).sum())
                for x, y in dist]  # fmt: skip
        epochs.append({"seen": list(ds.seen), "sums": sums})
    everyone = comm.all_gather_object(epochs)
    sizes_f = [15] * 6 + [10]  # 15 = 8 + 7
    out["custom"] = {"counts": [len(e["seen"]) for e in epochs], "sums": [e["sums"] for e in epochs],
                     "orders": [global_order([e[i]["seen"] for e in everyone], sizes_f) for i in range(2)],
                     "x": ds.x}  # fmt: skip

    return out


def more_worker(backup_dir: str) -> dict[str, Any]:
    """Resume, an IterableDataset and a replica mismatch on 2 replicas (the slow tier)."""
    mirrored = sg.MirroredStrategy(devices="cpu", num_replicas=2, timeout=60)
    one = sg.OneDeviceStrategy()
    out: dict[str, Any] = {}
    # (d) interrupted mid-epoch under BackupAndRestore, then resumed: the uninterrupted run
    out["resume"] = resume_run(mirrored, unseeded_loader, backup_dir + "/a")
    out["resume_seeded"] = resume_run(mirrored, seeded_loader, backup_dir + "/b")

    # (e) an IterableDataset loader: read whole by each replica and split, as one process's batches
    model, _ = train(mirrored, tud.DataLoader(Stream(200), batch_size=64), epochs=1)
    ref_model, _ = train(one, tud.DataLoader(Stream(200), batch_size=64), epochs=1)
    out["iterable"] = {"params": params_of(model), "ref": params_of(ref_model)}

    # (g) a batch sampler of its own seeded apart on each replica: an error saying so
    try:
        train(
            mirrored,
            tud.DataLoader(
                Counted(64), batch_sampler=OwnShuffle(64, 16, mirrored.extended.replica_id)
            ),
            epochs=1,
        )
        out["mismatch"] = None
    except Exception as e:  # noqa: BLE001 - the test reads the error
        out["mismatch"] = f"{type(e).__name__}: {e}"
    return out


class OwnShuffle:
    """A batch sampler of its own (no ``sampler`` to seed), shuffling with ``seed``."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.g = n, batch_size, torch.Generator().manual_seed(seed)

    def __iter__(self) -> Any:
        order = torch.randperm(self.n, generator=self.g).tolist()
        return (order[i : i + self.batch_size] for i in range(0, self.n, self.batch_size))

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)


def unseeded_loader(ds: Counted) -> tud.DataLoader:
    return tud.DataLoader(ds, batch_size=64, shuffle=True)


def seeded_loader(ds: Counted) -> tud.DataLoader:
    return tud.DataLoader(
        ds, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(5)
    )


def resume_run(strategy: Any, make: Any, backup_dir: str) -> dict[str, Any]:
    """3 epochs over ``make(Counted(200))``; then interrupted after step 6 and resumed."""
    full, full_hist = train(strategy, make(Counted(200)), epochs=3)
    model, opt = build(strategy)
    try:
        fit(model, opt, nn.CrossEntropyLoss(), make(Counted(200)), strategy=strategy, verbose=0, epochs=3,
            callbacks=[C.BackupAndRestore(backup_dir, save_freq=1), Crash(6)])  # fmt: skip
    except KeyboardInterrupt:
        pass
    model, opt = build(strategy)
    torch.manual_seed(1234)  # the restored job seed, not this process's, must decide the order
    backup = C.BackupAndRestore(backup_dir, save_freq=1)
    ds = Counted(200)
    hist = fit(
        model,
        opt,
        nn.CrossEntropyLoss(),
        make(ds),
        strategy=strategy,
        verbose=0,
        epochs=3,
        callbacks=[backup],
    )
    return {"params": params_of(model), "full": params_of(full), "restored_from": backup.restored_from,
            "history": hist.history, "full_history": full_hist.history, "fetched": len(ds.seen)}  # fmt: skip
