"""Workers for test_determinism.py: fit a model with dropout, AdamW and clipping; hash its parameters."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

import stratagem as sg


def _data(dataset: bool = False) -> Any:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 12, generator=g), torch.randint(0, 5, (96,), generator=g)
    if dataset:  # a stratagem Dataset: under Mirrored each replica's pipeline reads its share
        return sg.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=5).batch(24)
    return [(x[i : i + 24], y[i : i + 24]) for i in range(0, 96, 24)]  # global batches of 24


def _fit(strategy: Any, dataset: bool = False) -> tuple[str, list[float]]:
    torch.manual_seed(0)
    with strategy.scope() if strategy is not None else torch.no_grad():
        model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.25), nn.Linear(32, 32), nn.Tanh(),
                              nn.Linear(32, 5))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    history = sg.fit(model, opt, nn.CrossEntropyLoss(), _data(dataset), epochs=2, global_clipnorm=0.5, strategy=strategy,
                     verbose=0)  # fmt: skip
    digest = hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters()))
    return digest.hexdigest(), [float(v) for v in history.history["loss"]]


def hashes(kind: str, replicas: int, dataset: bool = False) -> dict[str, Any]:
    """The parameters' SHA-256 after fit, in the deterministic mode and in the default one."""
    if kind == "one":
        strategy = None
    elif kind == "mirrored":
        strategy = sg.MirroredStrategy(devices="cpu", num_replicas=replicas, timeout=60)
    else:
        strategy = sg.MultiWorkerMirroredStrategy()
    sg.experimental.enable_op_determinism(piece_size=4)
    deterministic = _fit(strategy, dataset)
    sg.experimental.disable_op_determinism()
    default = _fit(strategy, dataset)
    return {"deterministic": deterministic, "default": default}


def refused(what: str) -> str:
    """The error the deterministic mode gives for ``what`` (one process)."""
    sg.experimental.enable_op_determinism(piece_size=5)
    torch.manual_seed(0)
    if what == "batchnorm-loop":  # a custom loop's strategy.run
        strategy = sg.MirroredStrategy(devices="cpu", num_replicas=1)
        with strategy.scope():
            net = nn.Sequential(nn.Linear(12, 8), nn.BatchNorm1d(8), nn.Linear(8, 5))
        try:
            strategy.run(lambda x: net(x).sum().backward(), args=(torch.randn(10, 12),))
        except ValueError as e:
            return str(e)
        return "no error"
    if what == "batchnorm":
        model: nn.Module = nn.Sequential(nn.Linear(12, 8), nn.BatchNorm1d(8), nn.Linear(8, 5))
        kwargs: dict[str, Any] = {}
    elif what == "accumulation":
        model, kwargs = nn.Linear(12, 5), {"gradient_accumulation_steps": 2}
    else:  # a batch that is not a multiple of the piece size
        model, kwargs = nn.Linear(12, 5), {}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data() if what != "batch" else [(torch.randn(12, 12), torch.randint(0, 5, (12,)))]
    if what != "batch":
        data = [(x[:20], y[:20]) for x, y in data]
    try:
        sg.fit(model, opt, nn.CrossEntropyLoss(), data, epochs=1, verbose=0, **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


def nanogpt_hash(replicas: int) -> str:
    """nanoGPT as published (its model.py, its configure_optimizers' AdamW groups, dropout 0.1),
    fit for 3 steps of 8 sequences in the deterministic mode; its parameters' SHA-256."""
    import contextlib
    import io
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "real_models"))
    import real_cases as cases
    from nanogpt_model import GPT, GPTConfig

    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=replicas, timeout=60) if replicas > 1 else None
    sg.experimental.enable_op_determinism(piece_size=2)
    torch.manual_seed(0)
    config = GPTConfig(block_size=cases.T, vocab_size=cases.VOCAB, n_layer=2, n_head=2, n_embd=16, dropout=0.1, bias=True)
    with strategy.scope() if strategy is not None else contextlib.nullcontext(), contextlib.redirect_stdout(io.StringIO()):
        model = GPT(config)
        opt = cases.nanogpt_optimizer(model)
    sg.fit(model, opt, cases.token_losses, cases.nanogpt_batches(), epochs=2, global_clipnorm=0.3, strategy=strategy,
           verbose=0)  # fmt: skip
    return hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters())).hexdigest()


def resumed_hash(replicas: int, backup_dir: str, kill_at: int | None) -> dict[str, Any]:
    """3 epochs in the deterministic mode on a shuffled Dataset with BackupAndRestore every 2
    steps, on ``replicas`` replicas, SIGKILLed after update ``kill_at`` (None: to the end)."""
    from fit_workers import Killer

    from stratagem.train import callbacks as C

    strategy = sg.OneDeviceStrategy() if replicas == 1 else sg.MirroredStrategy(devices="cpu", num_replicas=replicas, timeout=60)
    sg.experimental.enable_op_determinism(piece_size=4)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.25), nn.Linear(32, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    backup = C.BackupAndRestore(backup_dir, save_freq=2, delete_checkpoint=False)
    callbacks: list[Any] = [backup] + ([Killer(kill_at)] if kill_at is not None else [])
    sg.fit(model, opt, nn.CrossEntropyLoss(), _data(dataset=True), epochs=3, global_clipnorm=0.5, callbacks=callbacks,
           strategy=strategy, verbose=0)  # fmt: skip
    digest = hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters()))
    return {"hash": digest.hexdigest(), "restored_from": backup.restored_from}


def custom_loop_hash(kind: str, replicas: int) -> dict[str, Any]:
    """TensorFlow's custom training loop with tf.distribute, as its tutorial writes it (a step that
    computes per-example losses, compute_average_loss with the global batch size, then the update
    inside strategy.run; strategy.reduce of the returned losses), with torch's AdamW, global
    clipping and dropout, in the deterministic mode: the parameters' SHA-256 and the epochs' losses."""
    import torch.nn.functional as F  # noqa: N812

    if kind == "one":
        strategy: Any = sg.MirroredStrategy(devices="cpu", num_replicas=1)
    elif kind == "mirrored":
        strategy = sg.MirroredStrategy(devices="cpu", num_replicas=replicas, timeout=60)
    else:
        strategy = sg.MultiWorkerMirroredStrategy()
    sg.experimental.enable_op_determinism(piece_size=4)
    global_batch = 24
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.25), nn.Linear(32, 32), nn.Tanh(),
                              nn.Linear(32, 5))  # fmt: skip
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dist_dataset = strategy.experimental_distribute_dataset(_data())

    def train_step(inputs: Any) -> torch.Tensor:
        x, y = inputs
        optimizer.zero_grad()
        per_example_loss = F.cross_entropy(model(x), y, reduction="none")
        loss = sg.compute_average_loss(per_example_loss, global_batch_size=global_batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        return loss

    losses = []
    for _ in range(2):
        total, batches = 0.0, 0
        for x in dist_dataset:
            per_replica_losses = strategy.run(train_step, args=(x,))
            total += float(strategy.reduce("sum", per_replica_losses, axis=None))
            batches += 1
        losses.append(total / batches)
    sg.experimental.disable_op_determinism()
    digest = hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters()))
    return {"hash": digest.hexdigest(), "loss": losses}


def custom_loop_resumed_hash(replicas: int, directory: str, kill_after: int | None) -> dict[str, Any]:
    """The custom training loop above over 2 epochs of a global-batch list, a checkpoint after every
    step (model, optimizer, the distributed iterator's position, RNGState), on ``replicas``
    replicas; every replica SIGKILLs itself after step ``kill_after`` (None: to the end). Started
    again, it restores the newest checkpoint and goes on."""
    import os
    import signal

    import torch.nn.functional as F  # noqa: N812

    strategy: Any = sg.MirroredStrategy(devices="cpu", num_replicas=replicas, timeout=60)
    sg.experimental.enable_op_determinism(piece_size=4)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.25), nn.Linear(32, 5))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 12, generator=g), torch.randint(0, 5, (96,), generator=g)
    data = sg.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=5).batch(24).repeat(2)  # 8 global batches
    options = sg.data.Options()  # every replica reads the global batches (tf's OFF): a position for any replica count
    options.experimental_distribute.auto_shard_policy = sg.data.AutoShardPolicy.OFF
    data = data.with_options(options)
    iterator = iter(strategy.experimental_distribute_dataset(data))
    manager = sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=optimizer, data=iterator, rng=sg.RNGState()),
                                   directory, max_to_keep=2)  # fmt: skip
    restored = manager.restore_or_initialize()

    def train_step(inputs: Any) -> torch.Tensor:
        x, y = inputs
        optimizer.zero_grad()
        loss = sg.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=24)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        return loss

    step = int(restored.rsplit("-", 1)[-1]) if restored else 0
    for inputs in iterator:
        strategy.run(train_step, args=(inputs,))
        step += 1
        manager.save(step)
        if kill_after is not None and step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    sg.experimental.disable_op_determinism()
    digest = hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters()))
    return {"hash": digest.hexdigest(), "restored": restored, "steps": step}
