"""Micro-batching: split a mini-batch into M micro-batches (sizes differ by at most one), scale
their losses so the gradients equal the whole mini-batch's, and join outputs back."""

from __future__ import annotations

from typing import Any

import torch

from stratagem.core import batches


def split_sizes(batch_size: int, num_microbatches: int) -> list[int]:
    """Sizes of the micro-batches (``torch.tensor_split``: the first ``B mod M`` get one more)."""
    if batch_size < num_microbatches:
        raise ValueError(
            f"a mini-batch of {batch_size} examples cannot be split into {num_microbatches} "
            f"micro-batches; use a batch of at least {num_microbatches} examples or fewer "
            "micro-batches (num_microbatches)"
        )
    return batches.split_sizes(batch_size, num_microbatches)


def batch_size(batch: Any) -> int:
    """The leading dimension shared by every tensor of ``batch``."""
    return batches.batch_size_of(batch, "a mini-batch")


def scatter(batch: Any, sizes: list[int]) -> list[Any]:
    """``batch`` (a tensor or nested tensors) cut along dimension 0 into pieces of ``sizes``."""
    return batches.split_batch(batch, sizes)


def gather(outputs: list[torch.Tensor]) -> torch.Tensor:
    """The micro-batch outputs joined along dimension 0."""
    return batches.concat(outputs)  # type: ignore[no-any-return]


REDUCTIONS = ("mean", "sum")


def loss_reduction_of(loss_fn: Any, given: str | None) -> str:
    """``"mean"`` or ``"sum"``: how ``loss_fn`` reduces over the batch (``given`` wins)."""
    if given is not None:
        if given not in REDUCTIONS:
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {given!r}")
        return given
    found = getattr(loss_fn, "reduction", None)
    if found == "batchmean":
        return "mean"
    if found in REDUCTIONS:
        return str(found)
    raise ValueError(
        f"cannot tell how {getattr(loss_fn, '__name__', type(loss_fn).__name__)} reduces over the "
        f"batch (its .reduction is {found!r}); pass loss_reduction='mean' or 'sum' to "
        "strategy.pipeline(...), and make the loss return a scalar"
    )


def loss_scales(sizes: list[int], reduction: str, global_batch: int) -> list[float]:
    """Factors for the micro-batch losses so their sum's gradient equals the mini-batch loss's.

    A mean over ``global_batch`` examples is the sum of micro-batch means times ``b_i / N``; a sum
    needs no scaling. ``global_batch`` counts every data-parallel copy's examples (their
    gradients are summed).
    """
    if reduction == "sum":
        return [1.0] * len(sizes)
    return [n / global_batch for n in sizes]
