"""Workers for tests/train/test_one_house.py: the strategy belongs to the model, fit shards its
input, and the collectives a step issues (run by run_workers on 2 CPU replicas)."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch import nn

import stratagem as sg
from stratagem.comm import ProcessGroupCommunicator
from stratagem.data import Dataset


def _data(n: int = 40, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 20, generator=g), torch.randint(0, 2, (n,), generator=g)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 2))


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return ""


def readme_fit_worker() -> dict[str, Any]:
    """The README's fit call shape exactly: model made in the scope, fit called outside it with
    no strategy=; then the mismatches, which must raise on every replica."""
    x, y = _data()
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    torch.manual_seed(0)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.Adam(model.parameters())
    train = Dataset.from_tensor_slices((x, y)).shuffle(len(y), seed=0).batch(8)
    history = sg.fit(model, optimizer, nn.CrossEntropyLoss(), train, epochs=2,
                     metrics=["sparse_categorical_accuracy"], verbose=0)
    out: dict[str, Any] = {"params": _params(model), "history": dict(history.history)}
    out["owner_is_strategy"] = sg.strategy_of(model) is strategy and sg.strategy_of(optimizer) is strategy

    one = sg.OneDeviceStrategy("cpu")
    out["explicit_other"] = _error(lambda: sg.fit(model, optimizer, nn.CrossEntropyLoss(), train,
                                                  strategy=one, verbose=0))
    with one.scope():
        out["open_other_scope"] = _error(lambda: sg.fit(model, optimizer, nn.CrossEntropyLoss(), train,
                                                        verbose=0))
    plain = _model()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    out["plain_under_mirrored"] = _error(lambda: sg.fit(plain, plain_opt, nn.CrossEntropyLoss(), train,
                                                        strategy=strategy, verbose=0))
    out["checkpoint_other"] = _error(lambda: sg.CheckpointManager(sg.Checkpoint(model=model), "/tmp/unused",
                                                                   strategy=one))

    def backward_outside_run() -> None:
        nn.functional.cross_entropy(model(x[:4]), y[:4]).backward()

    out["backward_outside_run"] = _error(backward_outside_run)
    return out


def readme_fit_reference() -> dict[str, Any]:
    x, y = _data()
    strategy = sg.OneDeviceStrategy("cpu")
    torch.manual_seed(0)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.Adam(model.parameters())
    train = Dataset.from_tensor_slices((x, y)).shuffle(len(y), seed=0).batch(8)
    history = sg.fit(model, optimizer, nn.CrossEntropyLoss(), train, epochs=2,
                     metrics=["sparse_categorical_accuracy"], verbose=0)
    return {"params": _params(model), "history": dict(history.history)}


_calls = collections.Counter()


def _count(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _calls["map"] += 1
    return x, y


def sharded_fit_worker() -> dict[str, Any]:
    """fit with a stratagem Dataset: each replica's pipeline maps only its own elements."""
    x, y = _data(44)
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    torch.manual_seed(1)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = Dataset.from_tensor_slices((x, y)).map(_count).batch(8)  # 44 = 5 x 8 + 4
    _calls.clear()
    sg.fit(model, optimizer, nn.CrossEntropyLoss(), train, epochs=1, verbose=0)
    fit_calls = _calls["map"]
    _calls.clear()
    sg.evaluate(model, nn.CrossEntropyLoss(), train)
    eval_calls = _calls["map"]
    _calls.clear()
    out = sg.predict(model, train)
    return {"fit_map_calls": fit_calls, "evaluate_map_calls": eval_calls,
            "predict_map_calls": _calls["map"], "params": _params(model), "predict": out}


def sharded_fit_reference() -> dict[str, Any]:
    x, y = _data(44)
    strategy = sg.OneDeviceStrategy("cpu")
    torch.manual_seed(1)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = Dataset.from_tensor_slices((x, y)).batch(8)
    sg.fit(model, optimizer, nn.CrossEntropyLoss(), train, epochs=1, verbose=0)
    return {"params": _params(model), "predict": sg.predict(model, train)}


class _Counting:
    """Counts this process's collectives (every ProcessGroupCommunicator operation)."""

    OPS = ("all_reduce_", "all_reduce_async", "all_gather_tensor", "broadcast_", "all_gather_object",
           "gather_object", "barrier")

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Counting:
        for name in self.OPS:
            original = getattr(ProcessGroupCommunicator, name)
            self._saved[name] = original

            def wrapped(comm: Any, *a: Any, _name: str = name, _orig: Any = original, **k: Any) -> Any:
                self.counts[_name] += 1
                return _orig(comm, *a, **k)

            setattr(ProcessGroupCommunicator, name, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(ProcessGroupCommunicator, name, original)

    def take(self) -> dict[str, int]:
        out = dict(self.counts)
        self.counts.clear()
        return out


def collectives_worker() -> dict[str, Any]:
    """Collectives per steady-state step: the custom loop (run + compute_average_loss + reduce of
    the loss) and fit with one metric; gradient buckets counted apart (all_reduce_async)."""
    x, y = _data(64)
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss(reduction="none")

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = sg.compute_average_loss(loss_fn(model(xb), yb))
        loss.backward()
        optimizer.step()
        return loss.detach()

    data = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    per_step = []
    with _Counting() as counting:
        it = iter(strategy.experimental_distribute_dataset(data))
        for xb, yb in it:
            strategy.reduce("sum", strategy.run(step, args=(xb, yb)))
            per_step.append(counting.take())
        train = Dataset.from_tensor_slices((x, y)).batch(16)
        counting.take()
        fit_steps: list[dict[str, int]] = []

        class Probe(sg.Callback):
            may_stop_per_batch = False  # it never stops training: fit need not agree after each batch

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                fit_steps.append(counting.take())

        sg.fit(model, optimizer, nn.CrossEntropyLoss(), train, epochs=1, verbose=0,
               metrics=["sparse_categorical_accuracy"], callbacks=[Probe()])
        counting.take()
        may_stop: list[dict[str, int]] = []

        class MayStop(sg.Callback):  # a batch hook that may set model.stop_training (Keras's habit)
            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                may_stop.append(counting.take())

        sg.fit(model, optimizer, nn.CrossEntropyLoss(), train, epochs=1, verbose=0,
               metrics=["sparse_categorical_accuracy"], callbacks=[MayStop()])
        counting.take()
        executions: list[dict[str, int]] = []

        class PerExecution(sg.Callback):  # with steps_per_execution=N, called once per N steps
            may_stop_per_batch = False

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                executions.append(counting.take())

        sg.fit(model, optimizer, nn.CrossEntropyLoss(), Dataset.from_tensor_slices((x, y)).batch(8), epochs=1,
               verbose=0, metrics=["sparse_categorical_accuracy"], callbacks=[PerExecution()], steps_per_execution=4)
    return {"loop": per_step, "fit": fit_steps, "may_stop": may_stop, "executions": executions}


def _precision_run(strategy: Any, precision: str, spe: Any = "auto") -> dict[str, Any]:
    x, y = _data(64, seed=9)
    torch.manual_seed(3)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    train = Dataset.from_tensor_slices((x, y)).batch(16)
    history = sg.fit(model, optimizer, nn.CrossEntropyLoss(), train, epochs=2, verbose=0,
                     metrics=["sparse_categorical_accuracy"], precision=precision, steps_per_execution=spe)
    return {"params": _params(model), "history": dict(history.history)}


def precision_worker() -> dict[str, Any]:
    """fit in bf16 and fp16 (and fp32 with steps_per_execution=3) on 2 replicas; the custom loop
    with RunOptions(precision=...) and a LossScaler whose state a Checkpoint keeps."""
    strategy = sg.MirroredStrategy("cpu", num_replicas=2)
    out = {p: _precision_run(strategy, p) for p in ("bf16", "fp16")}
    out["spe3"] = _precision_run(strategy, "32", spe=3)
    # custom loop: autocast through RunOptions, fp16 loss scaling through LossScaler
    x, y = _data(32, seed=4)
    torch.manual_seed(5)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = sg.mixed_precision.LossScaler("cpu")
    loss_fn = nn.CrossEntropyLoss(reduction="none")

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        logits = model(xb)
        loss = sg.compute_average_loss(loss_fn(logits.float(), yb))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        return torch.tensor(float(logits.dtype == torch.float16))

    data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    dtypes = []
    for xb, yb in strategy.experimental_distribute_dataset(data):
        dtypes.append(float(strategy.run(step, args=(xb, yb), options=sg.RunOptions(precision="fp16"))))
    ckpt = sg.Checkpoint(model=model, scaler=scaler)
    out["custom"] = {"params": _params(model), "fp16_forward": dtypes, "scale": scaler.get_scale(),
                     "skipped": scaler.skipped_steps, "encoded": sorted(ckpt.encode(shared=None)[0])}
    return out


def precision_reference() -> dict[str, Any]:
    one = sg.OneDeviceStrategy("cpu")
    return {p: _precision_run(one, p) for p in ("bf16", "fp16", "32")}
