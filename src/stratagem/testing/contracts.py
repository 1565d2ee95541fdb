"""Contracts every strategy must keep, as functions a test (or a user) can call.

``assert_matches_single_device``: training under a strategy gives the parameters that plain
single-process training on the same global batches gives, and replicas stay bit-identical.
Call it in every process of the job (e.g. from a function run by ``run_workers``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.distribute import Strategy, compute_average_loss

Batch = tuple[torch.Tensor, torch.Tensor]


def train_reference(
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    per_example_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    global_batches: Sequence[Batch],
    *,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process: the mean loss over each global batch, one step per batch."""
    torch.manual_seed(seed)
    model = make_model()
    opt = make_optimizer(model.parameters())
    for x, y in global_batches:
        opt.zero_grad()
        per_example_loss(model(x), y).mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_under(
    strategy: Strategy,
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    per_example_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    global_batches: Sequence[Batch],
    *,
    seed: int = 0,
    wrap_step: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> tuple[nn.Module, list[float]]:
    """The same training written once for any strategy: scope, distributed data, run, reduce."""
    torch.manual_seed(seed)
    with strategy.scope():
        model = make_model()
        opt = make_optimizer(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = compute_average_loss(per_example_loss(model(x), y))
        loss.backward()
        opt.step()
        return loss.detach()

    fn = wrap_step(step) if wrap_step is not None else step
    losses = []
    for x, y in strategy.experimental_distribute_dataset(global_batches):
        loss = strategy.run(fn, args=(x, y))
        losses.append(float(strategy.reduce("sum", loss)))
    return model, losses


def assert_replicas_identical(strategy: Strategy, module: nn.Module) -> None:
    """Every replica holds bit-identical parameters and buffers."""
    for name, t in module.state_dict().items():
        gathered = strategy.gather(t.detach().reshape(1, -1), axis=0)
        for r in range(gathered.shape[0]):
            if not torch.equal(gathered[r], gathered[0]):
                raise AssertionError(f"replica {r} differs from replica 0 in {name!r}")


def assert_matches_single_device(
    strategy: Strategy,
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    per_example_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    global_batches: Sequence[Batch],
    *,
    seed: int = 0,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    wrap_step: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> nn.Module:
    """Train under ``strategy`` and on one process; the parameters must agree everywhere."""
    model, _ = train_under(
        strategy, make_model, make_optimizer, per_example_loss, global_batches, seed=seed, wrap_step=wrap_step
    )
    expected = train_reference(make_model, make_optimizer, per_example_loss, global_batches, seed=seed)
    got = model.state_dict()
    for name, want in expected.items():
        have = got[name].detach().cpu()
        if not torch.allclose(have, want, rtol=rtol, atol=atol):
            diff = (have - want).abs().max().item()
            raise AssertionError(
                f"{name}: distributed training differs from single-device training by {diff:.3g} "
                f"(rtol={rtol}, atol={atol})"
            )
    assert_replicas_identical(strategy, model)
    return model
