"""Batches of nested tensors: split sizes (the plan), batch size, slicing, joining, placing.

Every layer that cuts a batch uses these: the replicas' share of a global batch
(``distribute``), the micro-batches of a mini-batch (``pipeline``), the per-example losses and
predictions fit collects (``train``). ``split_sizes`` is pure: ``torch.tensor_split``'s rule,
the first ``n mod parts`` pieces get one element more (tf.distribute's rebatching uses the same).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch

from stratagem.core import tree


def split_sizes(batch_size: int, parts: int) -> list[int]:
    """How many elements each of ``parts`` pieces of a batch of ``batch_size`` gets."""
    if parts < 1:
        raise ValueError(f"cannot split a batch into {parts} parts")
    base, extra = divmod(batch_size, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def _numbers(x: Any) -> bool:
    return (
        isinstance(x, (list, tuple))
        and bool(x)
        and not hasattr(x, "_fields")
        and all(isinstance(v, numbers.Number) for v in x)
    )


def to_tensors(batch: Any) -> Any:
    """A batch with numpy arrays and flat lists of numbers turned into tensors."""

    def convert(x: Any) -> Any:
        if _numbers(x):
            return torch.tensor(x)
        if isinstance(x, np.ndarray):
            return torch.from_numpy(x)
        return x

    return tree.map_structure(convert, batch, is_leaf=_numbers)


def batch_size_of(batch: Any, what: str = "a global batch") -> int:
    """The common leading dimension of a batch's tensors; a clear error when they disagree."""
    leaves = tree.leaves(batch)
    sizes = []
    for x in leaves:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise ValueError(
                f"{what} must hold tensors with a batch dimension; got a leaf "
                f"{type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' of shape ()'} "
                f"in {tree.signature(batch)}"
            )
        sizes.append(int(x.shape[0]))
    if not sizes:
        raise ValueError(f"{what} must hold at least one tensor")
    if len(set(sizes)) > 1:
        raise ValueError(
            f"the tensors of {what} have different batch sizes {sizes} ({tree.signature(batch)}); "
            "every tensor must have the same first dimension"
        )
    return sizes[0]


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Elements ``start:stop`` of every tensor of ``batch``."""
    return tree.map_structure(lambda t: t[start:stop], batch)


def split_batch(batch: Any, sizes: list[int]) -> list[Any]:
    """``batch`` cut along dimension 0 into consecutive pieces of ``sizes``."""
    out = []
    start = 0
    for n in sizes:
        out.append(slice_batch(batch, start, start + n))
        start += n
    return out


def concat(parts: list[Any]) -> Any:
    """Batches of the same structure joined along dimension 0, leaf by leaf (None when empty)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    flat0, spec = tree.flatten(parts[0])
    columns = [tree.leaves(p) for p in parts]
    return tree.unflatten(spec, [torch.cat([c[i] for c in columns]) for i in range(len(flat0))])


def place(value: Any, device: torch.device | None) -> Any:
    """``value`` with its tensors moved to ``device`` (None leaves them)."""
    if device is None:
        return value
    return tree.map_structure(
        lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, value
    )


def detach(value: Any) -> Any:
    """``value`` with its tensors detached from autograd."""
    return tree.map_structure(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value)
