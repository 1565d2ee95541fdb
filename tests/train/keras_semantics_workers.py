"""Workers for tests/train/test_keras_semantics.py: Keras's fit/evaluate/predict semantics on 2
CPU replicas (MirroredStrategy) and the same programs on one device, for parity."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import stratagem as sg
from stratagem.data import Dataset


def _data(n: int = 48, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _softmax_model(strategy: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3), nn.Softmax(dim=-1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, optimizer


class StopOnOneReplica(sg.callbacks.Callback):
    """Keras's habit, ``self.model.stop_training = True``, asked by one replica only."""

    def __init__(self, replica: int, batch: int | None = None, epoch: int | None = None) -> None:
        super().__init__()
        self.replica, self.batch, self.epoch = replica, batch, epoch
        self.batches: list[int] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches.append(batch)
        if batch == self.batch and self.state.strategy.extended.replica_id == self.replica:
            self.model.stop_training = True

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.epoch and self.state.strategy.extended.replica_id == self.replica:
            self.model.stop_training = True


class Asymmetric(sg.losses.Loss):
    """A Keras-style loss whose terms are not symmetric in (y_true, y_pred)."""

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        err = y_pred - y_true.unsqueeze(-1).float()
        return torch.where(err < 0, 3.0 * err**2, err.abs()).mean(dim=-1)


def _programs(strategy: Any, replica: int | None, tmp: str) -> dict[str, Any]:
    """The same Keras-style programs; ``replica`` is the replica whose callback asks to stop
    (None on one device: the only one, 0)."""
    out: dict[str, Any] = {}
    x, y = _data()
    data = Dataset.from_tensor_slices((x, y)).batch(8)  # 6 global batches

    # 1. a Keras-named loss on a softmax model: probabilities in, the model's cross-entropy out
    # with the tutorials' ModelCheckpoint(filepath=".../ckpt_{epoch}") and latest_checkpoint
    model, opt = _softmax_model(strategy)
    checkpoint_dir = os.path.join(tmp, "training_checkpoints")
    checkpoint = sg.callbacks.ModelCheckpoint(filepath=os.path.join(checkpoint_dir, "ckpt_{epoch}"), save_weights_only=True)
    hist = sg.fit(model, opt, "sparse_categorical_crossentropy", data, epochs=2, verbose=0, metrics=["accuracy"],
                  callbacks=[checkpoint])
    out["keras_name"] = {"params": _params(model), "history": dict(hist.history)}
    latest = sg.train.latest_checkpoint(checkpoint_dir)
    restored, _ = _softmax_model(strategy)
    sg.train.load_weights(restored, latest)
    out["checkpoint"] = {"latest": os.path.basename(latest or ""), "files": sorted(os.listdir(checkpoint_dir)),
                         "restored": _params(restored)}

    # 2. stop_training asked in on_train_batch_end at batch 1 by one replica: 2 batches trained
    model, opt = _softmax_model(strategy)
    cb = StopOnOneReplica(replica=replica or 0, batch=1)
    hist = sg.fit(model, opt, "sparse_categorical_crossentropy", data, epochs=3, verbose=0, callbacks=[cb])
    out["stop_batch"] = {"params": _params(model), "epochs": len(hist.history["loss"]), "batches": cb.batches,
                         "flag": bool(model.stop_training)}

    # 3. stop_training asked at the end of epoch 0 by one replica: 1 epoch of 3
    model, opt = _softmax_model(strategy)
    cb = StopOnOneReplica(replica=replica or 0, epoch=0)
    hist = sg.fit(model, opt, "sparse_categorical_crossentropy", data, epochs=3, verbose=0, callbacks=[cb])
    out["stop_epoch"] = {"params": _params(model), "epochs": len(hist.history["loss"])}

    # 4. a Keras-style Loss subclass: called (y_true, y_pred)
    torch.manual_seed(4)
    with strategy.scope():
        reg = nn.Linear(6, 1)
        reg_opt = torch.optim.SGD(reg.parameters(), lr=0.1)
    hist = sg.fit(reg, reg_opt, Asymmetric(), data, epochs=1, verbose=0)
    out["keras_loss"] = {"params": _params(reg), "history": dict(hist.history)}

    # 5. predict and evaluate on arrays (Keras's x, y and batch_size)
    model, _ = _softmax_model(strategy)
    xs, ys = x[:45], y[:45]
    out["predict"] = sg.predict(model, xs)  # batch_size None: 32 rows, then 13
    out["predict_np"] = sg.predict(model, xs.numpy().astype("float64"), batch_size=8)
    out["evaluate"] = sg.evaluate(model, "sparse_categorical_crossentropy", (xs, ys), batch_size=8,
                                  metrics=["accuracy"])
    out["evaluate_loss"] = sg.evaluate(model, "sparse_categorical_crossentropy", (xs, ys))
    return out


def semantics_reference(tmp: str) -> dict[str, Any]:
    return _programs(sg.OneDeviceStrategy("cpu"), None, tmp)


def semantics_worker(tmp: str) -> dict[str, Any]:
    strategy = sg.MirroredStrategy("cpu", num_replicas=2)
    return _programs(strategy, 1, tmp)  # only replica 1's callbacks ask to stop
