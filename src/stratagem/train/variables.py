"""Variable: a model's weight as Keras's torch backend hands it out (``v.value`` is the torch tensor).

Keras 3's guides for PyTorch write ``[v.value.grad for v in self.trainable_weights]`` and pass
the same list to ``optimizer.apply(grads, trainable_weights)``. ``Model.trainable_weights`` (and
``non_trainable_weights``, ``weights``) return these, so the guides run as written; torch code
that reads ``v.grad``, ``v.shape`` or calls a torch function on ``v`` works too (it is unwrapped
to ``v.value``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["Variable", "tensor_of"]


class Variable:
    """One weight of a model: ``value`` (the ``nn.Parameter`` or buffer itself, not a copy) and
    ``path`` (its name in ``state_dict``)."""

    __slots__ = ("path", "value")

    def __init__(self, value: torch.Tensor, path: str) -> None:
        self.value = value
        self.path = path

    @property
    def name(self) -> str:
        """The last part of ``path`` (``"weight"``, ``"bias"``), as Keras's ``variable.name``."""
        return self.path.rsplit(".", 1)[-1]

    @property
    def trainable(self) -> bool:
        return isinstance(self.value, torch.nn.Parameter) and self.value.requires_grad

    @property
    def grad(self) -> torch.Tensor | None:
        return self.value.grad

    @property
    def shape(self) -> torch.Size:
        return self.value.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.value.dtype

    def numpy(self) -> np.ndarray:
        return self.value.detach().cpu().numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out.astype(dtype) if dtype is not None else out

    def assign(self, value: Any) -> None:
        """Write ``value`` into the weight in place (Keras's ``variable.assign``)."""
        with torch.no_grad():
            self.value.copy_(torch.as_tensor(value, dtype=self.value.dtype, device=self.value.device))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = lambda a: a.value if isinstance(a, Variable) else a  # noqa: E731
        return func(*(unwrap(a) for a in args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"<Variable path={self.path}, shape={tuple(self.shape)}, dtype={str(self.dtype).replace('torch.', '')}>"


def tensor_of(v: Any) -> torch.Tensor:
    """The torch tensor of a ``Variable``, or ``v`` itself when it is a tensor."""
    if isinstance(v, Variable):
        return v.value
    if isinstance(v, torch.Tensor):
        return v
    raise TypeError(f"expected a model weight (a Variable from trainable_weights, or a torch tensor); got {type(v).__name__}")
