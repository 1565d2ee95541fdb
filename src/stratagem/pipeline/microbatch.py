"""Micro-batching: split a mini-batch into M micro-batches (sizes differ by at most one), scale
their losses so the gradients equal the whole mini-batch's, and join outputs back."""

from __future__ import annotations

from typing import Any

import torch

from stratagem.core import tree


def split_sizes(batch_size: int, num_microbatches: int) -> list[int]:
    """Sizes of the micro-batches (``torch.tensor_split``: the first ``B mod M`` get one more)."""
    if batch_size < num_microbatches:
        raise ValueError(
            f"a mini-batch of {batch_size} examples cannot be split into {num_microbatches} "
            f"micro-batches; use a batch of at least {num_microbatches} examples or fewer "
            "micro-batches (num_microbatches)"
        )
    base, extra = divmod(batch_size, num_microbatches)
    return [base + (1 if i < extra else 0) for i in range(num_microbatches)]


def batch_size(batch: Any) -> int:
    """The leading dimension shared by every tensor of ``batch``."""
    leaves, _ = tree.flatten(batch)
    sizes = {int(t.shape[0]) for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"the tensors of a mini-batch must share their first dimension; got {tree.signature(batch)}"
        )
    return sizes.pop()


def scatter(batch: Any, sizes: list[int]) -> list[Any]:
    """``batch`` (a tensor or nested tensors) cut along dimension 0 into pieces of ``sizes``."""
    out = []
    start = 0
    for n in sizes:
        out.append(_slice(batch, start, start + n))
        start += n
    return out


def _slice(batch: Any, start: int, stop: int) -> Any:
    return tree.map_structure(lambda t: t[start:stop], batch)


def gather(outputs: list[torch.Tensor]) -> torch.Tensor:
    """The micro-batch outputs joined along dimension 0."""
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


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
