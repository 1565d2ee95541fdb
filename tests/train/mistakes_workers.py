"""Workers for test_mistakes: the mistakes users make under a strategy, each as written."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn

import stratagem as sg
from stratagem.data import Dataset
from stratagem.train import fit


def _outcome(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        value = call()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"error": None, "value": value, "seconds": time.monotonic() - start}


def _data(n: int = 32) -> Dataset:
    g = torch.Generator().manual_seed(0)
    return Dataset.from_tensor_slices((torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)))


def _model_and_optimizer(strategy: Any, lr: float = 0.1) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return model, optimizer


def _fit(strategy: Any, model: nn.Module, optimizer: torch.optim.Optimizer, data: Any, **kw: Any) -> int:
    history = fit(model, optimizer, nn.CrossEntropyLoss(), data, strategy=strategy, verbose=0, **kw)
    return len(history.history["loss"])


def infinite_distributed(form: str) -> dict[str, Any]:
    """fit over a distributed infinite dataset without steps_per_epoch (it trained forever)."""
    strategy = sg.MirroredStrategy(num_replicas=2, devices="cpu", timeout=60)
    model, optimizer = _model_and_optimizer(strategy)
    if form == "distribute_dataset":
        data = strategy.experimental_distribute_dataset(_data().batch(8).repeat())
    elif form == "distribute_dataset_unbatched_source":  # not rebatched: read whole, then split
        data = strategy.experimental_distribute_dataset(_data().repeat().batch(8))
    else:
        data = strategy.distribute_datasets_from_function(
            lambda ctx: _data().shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(4).repeat()
        )
    return _outcome(lambda: _fit(strategy, model, optimizer, data, epochs=1))


def learning_rate_by_rank() -> dict[str, Any]:
    """Each replica builds its optimizer with another learning rate (read from the rank)."""
    strategy = sg.MirroredStrategy(num_replicas=2, devices="cpu", timeout=60)
    rank = strategy.cluster_spec.rank
    model, optimizer = _model_and_optimizer(strategy, lr=0.1 * (rank + 1))
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    out = {
        "list": _outcome(lambda: _fit(strategy, model, optimizer, data)),
        "dataset": _outcome(lambda: _fit(strategy, model, optimizer, _data().batch(8))),
    }
    # the same learning rate everywhere trains (and after the mismatch the job goes on)
    for group in optimizer.param_groups:
        group["lr"] = 0.1
    out["same"] = _outcome(lambda: _fit(strategy, model, optimizer, data))
    return out


def whole_tensors_and_float64() -> dict[str, Any]:
    """experimental_distribute_dataset((x, y)) of whole tensors; numpy float64 batches."""
    strategy = sg.MirroredStrategy(num_replicas=2, devices="cpu", timeout=60)
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    out = {"tuple": _outcome(lambda: strategy.experimental_distribute_dataset((x, y)))}
    batches = [(np.random.default_rng(i).normal(size=(8, 5)), np.arange(8) % 3) for i in range(2)]
    dist = strategy.experimental_distribute_dataset(batches)
    out["dtypes"] = [(str(bx.dtype), str(by.dtype), tuple(bx.shape)) for bx, by in dist]
    return out


def learning_rate_by_rank_continuing() -> dict[str, Any]:
    """The same mistake under FailureOptions(on_failure="continue") (every replica reads whole batches)."""
    strategy = sg.MirroredStrategy(num_replicas=2, devices="cpu", timeout=60,
                                   failure=sg.FailureOptions(on_failure="continue"))  # fmt: skip
    rank = strategy.cluster_spec.rank
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999 if rank == 0 else 0.99))
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    return _outcome(lambda: _fit(strategy, model, optimizer, data))


def map_error_in_a_share() -> dict[str, Any]:
    """A map function failing on element 11 of range(16), batched by 8 over 2 replicas: replica 0's
    share holds it (its element 7)."""
    strategy = sg.MirroredStrategy(num_replicas=2, devices="cpu", timeout=20)

    def check(x: Any) -> Any:
        if int(x) == 11:
            raise ValueError("element 11 is bad")
        return x

    dist = strategy.experimental_distribute_dataset(Dataset.range(16).map(check).batch(8))
    return _outcome(lambda: [b.tolist() for b in dist])
