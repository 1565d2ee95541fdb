"""Shared models, data and worker functions for the fit tests (importable by run_workers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stratagem.train import fit


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def global_batches(sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def build(strategy: Any, seed: int = 0, lr: float = 0.1) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    with strategy.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, opt


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def train(strategy: Any, data: Any, **kw: Any) -> tuple[nn.Module, Any]:
    model, opt = build(strategy)
    kw.setdefault("verbose", 0)
    history = fit(model, opt, nn.CrossEntropyLoss(), data, strategy=strategy, **kw)
    return model, history


# --- workers run by run_workers ---------------------------------------------------------------
import os  # noqa: E402
import signal  # noqa: E402

import stratagem as sg  # noqa: E402
from stratagem.data import Dataset  # noqa: E402
from stratagem.train import callbacks as C  # noqa: E402
from stratagem.train import evaluate, metrics, predict  # noqa: E402


def _history(h: Any) -> dict[str, list[float]]:
    return {k: list(v) for k, v in h.history.items()}


class StopOnReplica(C.Callback):
    """Asks to stop on one replica only: fit must still stop every replica at the same epoch."""

    def __init__(self, replica: int, epoch: int) -> None:
        super().__init__()
        self.replica, self.epoch = replica, epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.epoch and self.state.strategy.extended.replica_id == self.replica:
            self.state.stop_training = True


class Killer(C.Callback):
    """SIGKILLs this process after optimizer step ``at`` (every replica does, after a barrier)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.state.iterations == self.at:
            self.state.strategy.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


def backup_run(strategy: Any, backup_dir: str, kill_at: int | None) -> dict[str, Any]:
    """3 epochs on a shuffled Dataset (28 examples, batches of 6: the last is partial), dropout."""
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(28, 5, generator=g), torch.randint(0, 3, (28,), generator=g)
    data = Dataset.from_tensor_slices((x, y)).shuffle(28, seed=7).batch(6)
    backup = C.BackupAndRestore(backup_dir, save_freq=2)
    cbs: list[C.Callback] = [backup] + ([Killer(kill_at)] if kill_at is not None else [])
    hist = fit(model, opt, nn.CrossEntropyLoss(), data, epochs=3, validation_data=[(x[:10], y[:10])],
               metrics=["sparse_categorical_accuracy"], callbacks=cbs, strategy=strategy, verbose=0)
    return {"params": params_of(model), "history": _history(hist), "restored_from": backup.restored_from,
            "left": sorted(os.listdir(backup_dir)) if os.path.isdir(backup_dir) else []}


def backup_worker(backup_dir: str, kill_at: int | None) -> dict[str, Any]:
    return backup_run(sg.MirroredStrategy(devices="cpu", num_replicas=2, timeout=60), backup_dir, kill_at)


def parity_worker(ref_backup_dir: str) -> dict[str, Any]:
    """Everything that needs 2 replicas except the kill test, in one launch (torch imports once)."""
    mirrored = sg.MirroredStrategy(devices="cpu", num_replicas=2, timeout=60)
    one = sg.OneDeviceStrategy()
    rank = mirrored.extended.replica_id
    out: dict[str, Any] = {}
    data = global_batches([8, 8, 5, 1])  # the last global batch leaves replica 1 empty
    val = global_batches([6, 1], seed=2)
    mets = lambda: ["sparse_categorical_accuracy", metrics.TopKCategoricalAccuracy(k=2)]  # noqa: E731
    print(f"replica {rank} starts", flush=True)
    m_model, m_hist = train(mirrored, data, epochs=2, validation_data=val, metrics=mets(), verbose=2)
    o_model, o_hist = train(one, data, epochs=2, validation_data=val, metrics=mets(), verbose=0)
    out["mirrored"] = {"params": params_of(m_model), "history": _history(m_hist)}
    out["one"] = {"params": params_of(o_model), "history": _history(o_hist)}
    # the same global batches from a stratagem Dataset and a DataLoader
    x, y = torch.cat([b[0] for b in data[:3]]), torch.cat([b[1] for b in data[:3]])
    ds_model, _ = train(mirrored, Dataset.from_tensor_slices((x, y)).batch(8), epochs=2)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    dl_model, _ = train(mirrored, dl, epochs=2)
    ref_model, _ = train(one, data[:3], epochs=2)
    out["dataset"], out["dataloader"], out["ref3"] = params_of(ds_model), params_of(dl_model), params_of(ref_model)
    # evaluate and predict: global values, input order
    out["evaluate"] = evaluate(m_model, nn.CrossEntropyLoss(), data, metrics=["sparse_categorical_accuracy"], strategy=mirrored,
                               return_dict=True)
    out["predict"] = predict(m_model, data, strategy=mirrored)
    # a metric updated with this replica's slices (one empty, one with masked padding)
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 1, 0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    acc = metrics.SparseCategoricalAccuracy()
    mine = slice(0, 3) if rank == 0 else slice(3, 5)
    acc.update_state(labels[mine], logits[mine], sample_weight=mask[mine])
    acc.update_state(labels[:0], logits[:0])  # an empty batch
    out["acc_in_run"] = float(mirrored.run(lambda: acc.result()))
    metrics.sync_metrics(mirrored, [acc])
    out["acc_synced"] = float(acc.result())
    # EarlyStopping on a global log, and a stop asked on replica 1 only: all stop together
    _, h = train(mirrored, data, epochs=10, callbacks=[C.EarlyStopping("loss", min_delta=1e9, patience=1)])
    out["early_epochs"] = h.epoch
    _, h = train(mirrored, data, epochs=10, callbacks=[StopOnReplica(1, epoch=2)])
    out["asked_epochs"] = h.epoch
    # the uninterrupted reference for the kill test
    out["backup_ref"] = backup_run(mirrored, ref_backup_dir, None)
    return out


def pipeline_worker() -> dict[str, Any]:
    """fit/evaluate/predict under PipelineStrategy(2 stages, devices="cpu") vs OneDevice, in both usages."""
    from stratagem.distribute.strategies.pipeline import PipelineStrategy

    pipe_strategy = PipelineStrategy(2, 2, devices="cpu")
    one = sg.OneDeviceStrategy()
    data, val = global_batches([8, 8, 5]), global_batches([6, 4], seed=2)
    kw: dict[str, Any] = {"epochs": 2, "validation_data": val, "metrics": ["sparse_categorical_accuracy"]}
    out: dict[str, Any] = {"stage": pipe_strategy.stage}
    print(f"stage {pipe_strategy.stage} starts", flush=True)
    # 1. as under any strategy: model and optimizer built in the scope
    model, opt = build(pipe_strategy)
    hist = fit(model, opt, nn.CrossEntropyLoss(), data, strategy=pipe_strategy, verbose=2, **kw)
    local = {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"}
    out["scope"] = {"params": local, "history": _history(hist)}
    out["predict"] = predict(model, data, strategy=pipe_strategy)
    out["evaluate"] = evaluate(model, nn.CrossEntropyLoss(), data, strategy=pipe_strategy, return_dict=True)
    # 2. the pipeline module's own recipe: the Pipe and an optimizer over its parameters
    torch.manual_seed(0)
    with pipe_strategy.scope():
        pipe = pipe_strategy.pipeline(make_model(), nn.CrossEntropyLoss(), verbose=False)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    hist = fit(pipe, opt, nn.CrossEntropyLoss(), data, strategy=pipe_strategy, verbose=0, **kw)
    out["pipe"] = {"params": {n: p.detach().clone() for n, p in pipe.named_parameters()}, "history": _history(hist)}
    ref_model, ref_hist = train(one, data, **kw)
    out["ref"] = {"params": params_of(ref_model), "history": _history(ref_hist)}
    # 3. BackupAndRestore under a pipeline: one epoch, then a fresh run of two resumes from it
    import tempfile

    from stratagem.train.callbacks import BackupAndRestore

    world = pipe_strategy.extended.world  # type: ignore[attr-defined]
    backup = world.broadcast_object(tempfile.mkdtemp() if pipe_strategy.stage == 0 else None)
    first, first_opt = build(pipe_strategy)
    fit(first, first_opt, nn.CrossEntropyLoss(), data, strategy=pipe_strategy, verbose=0,
        callbacks=[BackupAndRestore(backup, delete_checkpoint=False)], **{**kw, "epochs": 1})
    second, second_opt = build(pipe_strategy)
    hist = fit(second, second_opt, nn.CrossEntropyLoss(), data, strategy=pipe_strategy, verbose=0,
               callbacks=[BackupAndRestore(backup)], **kw)
    out["resumed"] = {
        "params": {n: p.detach().clone() for n, p in second.named_parameters() if p.device.type != "meta"},
        "history": _history(hist),
    }
    return out


def multi_worker_worker() -> dict[str, Any]:
    """fit under MultiWorkerMirroredStrategy (list and stratagem Dataset input) vs OneDevice."""
    from stratagem.distribute.strategies.multi_worker import MultiWorkerMirroredStrategy

    mw = MultiWorkerMirroredStrategy(devices="cpu")
    one = sg.OneDeviceStrategy()
    data = global_batches([8, 8, 5, 1])
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    kw: dict[str, Any] = {"epochs": 2, "metrics": ["sparse_categorical_accuracy"]}
    m_model, m_hist = train(mw, data, **kw)
    d_model, d_hist = train(mw, Dataset.from_tensor_slices((x, y)).batch(8), **kw)
    o_model, o_hist = train(one, [(x[i : i + 8], y[i : i + 8]) for i in (0, 8, 16)], **kw)
    r_model, r_hist = train(one, data, **kw)
    return {
        "list": (params_of(m_model), _history(m_hist)), "ref_list": (params_of(r_model), _history(r_hist)),
        "dataset": (params_of(d_model), _history(d_hist)), "ref_dataset": (params_of(o_model), _history(o_hist)),
    }


def elastic_backup_run(replicas: int, backup_dir: str, kill_at: int | None, split: bool = True) -> dict[str, Any]:
    """3 epochs of a shuffled Dataset (36 examples, global batches of 6) with BackupAndRestore
    every 2 steps, on ``replicas`` replicas (1: OneDeviceStrategy), killed after step ``kill_at``.
    ``split``: each replica's pipeline reads its share (auto-shard DATA); else every replica reads
    the global batches and splits them (auto-shard OFF)."""
    strategy = sg.OneDeviceStrategy() if replicas == 1 else sg.MirroredStrategy(devices="cpu", num_replicas=replicas, timeout=60)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(36, 5, generator=g), torch.randint(0, 3, (36,), generator=g)
    data = Dataset.from_tensor_slices((x, y)).shuffle(36, seed=7).batch(6)
    if not split:
        from stratagem.data import AutoShardPolicy, Options

        options = Options()
        options.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
        data = data.with_options(options)
    backup = C.BackupAndRestore(backup_dir, save_freq=2, delete_checkpoint=False)
    cbs: list[C.Callback] = [backup] + ([Killer(kill_at)] if kill_at is not None else [])
    hist = fit(model, opt, nn.CrossEntropyLoss(), data, epochs=3, metrics=["sparse_categorical_accuracy"],
               callbacks=cbs, strategy=strategy, verbose=0)
    return {"params": params_of(model), "history": _history(hist), "restored_from": backup.restored_from}
