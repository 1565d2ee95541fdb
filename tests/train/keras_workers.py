"""Workers for tests/train/test_keras_habits.py: the replica-context API and fit's Keras options
on 2 CPU replicas, and their single-device references."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import stratagem as sg
from stratagem.data import Dataset


def _data(n: int = 48, seed: int = 11, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, classes, (n,), generator=g)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _fit(strategy: Any, batch: int, **kw: Any) -> dict[str, Any]:
    x, y = _data()
    torch.manual_seed(2)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
    # the model ends in a Linear layer: logits, so Keras's from_logits=True
    loss = kw.pop("loss", sg.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = sg.fit(model, opt, loss, Dataset.from_tensor_slices((x, y)).batch(batch), epochs=2, verbose=0,
                  metrics=["accuracy"], **kw)
    return {"params": _params(model), "history": dict(hist.history)}


def _binary(strategy: Any) -> dict[str, Any]:
    x, y = _data(classes=2)
    torch.manual_seed(4)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(6, 1), nn.Sigmoid())
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    hist = sg.fit(model, opt, "mse", Dataset.from_tensor_slices((x, y.float())).batch(8), epochs=2,
                  verbose=0, metrics=["accuracy", "mae"])
    return {"params": _params(model), "history": dict(hist.history)}


CASES = {
    "accumulate": lambda s, n: _fit(s, 8 // n * n, gradient_accumulation_steps=3),
    "clip": lambda s, n: _fit(s, 8, global_clipnorm=0.05, clipvalue=0.02),
    "class_weight": lambda s, n: _fit(s, 8, class_weight={0: 1.0, 1: 3.0, 2: 0.5}),
    "binary_mse": lambda s, n: _binary(s),
}


def keras_reference() -> dict[str, Any]:
    one = sg.OneDeviceStrategy("cpu")
    out = {name: case(one, 1) for name, case in CASES.items()}
    out["big_batch"] = _fit(one, 24)  # 3 accumulated batches of 8 = one batch of 24
    return out


def keras_worker() -> dict[str, Any]:
    strategy = sg.MirroredStrategy("cpu", num_replicas=2)
    r = strategy.extended.replica_id
    out: dict[str, Any] = {name: case(strategy, 2) for name, case in CASES.items()}

    # the replica-context API
    def replica_fn() -> Any:
        ctx = sg.get_replica_context()
        gathered = ctx.all_gather(torch.full((r + 1, 2), float(r)), axis=0)
        merged = ctx.merge_call(lambda s, v, scale: sum(float(t.sum()) for t in s.experimental_local_results(v)) * scale.values[0],
                                args=(torch.tensor([r + 1.0]),), kwargs={"scale": 10})
        return gathered, merged

    gathered, merged = strategy.run(replica_fn)
    values = strategy.experimental_distribute_values_from_function(lambda c: torch.tensor([c.replica_id_in_sync_group * 10]))
    out["api"] = {"gathered": gathered.tolist(), "merged": merged, "value": values.tolist(),
                  "local": len(strategy.experimental_local_results(values))}

    # counting gradient all-reduces per update under accumulation
    from stratagem.comm import ProcessGroupCommunicator

    calls = []
    original = ProcessGroupCommunicator.all_reduce_async

    def counting(comm: Any, t: torch.Tensor) -> Any:
        calls.append(t.numel())
        return original(comm, t)

    ProcessGroupCommunicator.all_reduce_async = counting  # type: ignore[method-assign]
    try:
        x, y = _data()
        with strategy.scope():
            model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
            opt = torch.optim.SGD(model.parameters(), lr=0.3)
        sg.fit(model, opt, sg.losses.SparseCategoricalCrossentropy(from_logits=True),
               Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0, gradient_accumulation_steps=3)
    finally:
        ProcessGroupCommunicator.all_reduce_async = original  # type: ignore[method-assign]
    out["bucket_reduces"] = len(calls)  # 48 / 8 = 6 batches -> 2 updates -> 2 bucket all-reduces

    # scale_regularization_loss: an L2 penalty on every replica counts once
    def reg_run(s: Any) -> dict[str, torch.Tensor]:
        x, y = _data(16, seed=3)
        torch.manual_seed(6)
        with s.scope():
            model = nn.Linear(6, 3)
            opt = torch.optim.SGD(model.parameters(), lr=0.2)
        loss_fn = nn.CrossEntropyLoss(reduction="none")

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            opt.zero_grad()
            l2 = sum((p**2).sum() for p in model.parameters())
            loss = sg.compute_average_loss(loss_fn(model(xb), yb)) + sg.scale_regularization_loss(0.1 * l2)
            loss.backward()
            opt.step()

        for xb, yb in s.experimental_distribute_dataset([(x[:8], y[:8]), (x[8:], y[8:])]):
            s.run(step, args=(xb, yb))
        return _params(model)

    out["reg"] = reg_run(strategy)
    out["reg_ref"] = reg_run(sg.OneDeviceStrategy("cpu"))
    return out
