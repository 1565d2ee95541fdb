"""Mixed precision: a Policy (what to compute in) and a LossScaler (fp16's loss scaling).

``Policy("bf16")`` runs forward passes under ``torch.autocast`` in bfloat16 on the replica's
device; ``Policy("fp16")`` in float16, with a :class:`LossScaler` (torch's ``GradScaler``) so
small gradients do not flush to zero. Parameters, gradients and optimizer state stay float32.
Under a data-parallel strategy the scaled gradients are summed across replicas before the scaler
looks at them, so an overflow on any replica is an overflow on every replica: the step is
skipped, and the scale lowered, everywhere alike. Keras's and Lightning's spellings are accepted
(``"mixed_bfloat16"``, ``"bf16-mixed"``, ``"mixed_float16"``, ``"16-mixed"``, ``"float32"``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

_NAMES = {
    "32": "32", "float32": "32", "fp32": "32", "32-true": "32",
    "bf16": "bf16", "bfloat16": "bf16", "mixed_bfloat16": "bf16", "bf16-mixed": "bf16",
    "fp16": "fp16", "float16": "fp16", "16": "fp16", "mixed_float16": "fp16", "16-mixed": "fp16",
}  # fmt: skip


_NOTHING = contextlib.nullcontext()  # reusable: entered once per step for "32"


@dataclass(frozen=True)
class Policy:
    """What the forward pass computes in: ``"32"``, ``"bf16"`` or ``"fp16"``."""

    name: str = "32"

    def __post_init__(self) -> None:
        canon = _NAMES.get(str(self.name).lower())
        if canon is None:
            raise ValueError(
                f"unknown precision {self.name!r}; use '32', 'bf16' or 'fp16' (Keras's "
                "'mixed_bfloat16'/'mixed_float16' are accepted too)"
            )
        object.__setattr__(self, "name", canon)

    @classmethod
    def of(cls, value: str | Policy | None) -> Policy:
        if isinstance(value, Policy):
            return value
        return cls("32" if value is None else str(value))

    @property
    def compute_dtype(self) -> torch.dtype:
        return {"32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.name]

    @property
    def needs_loss_scaling(self) -> bool:
        return self.name == "fp16"

    def autocast(self, device: torch.device | str | None) -> contextlib.AbstractContextManager[Any]:
        """Autocast to the compute dtype on ``device`` (nothing for ``"32"``)."""
        if self.name == "32":
            return _NOTHING
        kind = torch.device(device).type if device is not None else "cpu"
        return torch.autocast(kind, dtype=self.compute_dtype)

    def loss_scaler(self, device: torch.device | str | None) -> LossScaler | None:
        """A new LossScaler for fp16 (None for the other policies)."""
        return LossScaler(device) if self.needs_loss_scaling else None


class LossScaler:
    """fp16 loss scaling (``torch.amp.GradScaler``) with a checkpointable state.

    ``scaler.scale(loss).backward(); skipped = not scaler.step(optimizer); scaler.update()``.
    """

    def __init__(self, device: torch.device | str | None = None, **kwargs: Any) -> None:
        kind = torch.device(device).type if device is not None else "cpu"
        self._scaler = torch.amp.GradScaler(kind, **kwargs)
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self._scaler.scale(loss)  # type: ignore[no-any-return]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale now (before clipping them); ``step`` then won't."""
        self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the gradients and step, unless they hold inf/NaN; returns whether it stepped."""
        before = self._scaler.get_scale()
        self._scaler.step(optimizer)
        self._scaler.update()
        stepped = self._scaler.get_scale() >= before
        if not stepped:
            self.skipped_steps += 1
        return stepped

    def get_scale(self) -> float:
        return float(self._scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        return {**self._scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.skipped_steps = int(state.pop("skipped_steps", 0))
        self._scaler.load_state_dict(state)


@dataclass(frozen=True)
class RunOptions:
    """Options of one ``strategy.run`` call (tf.distribute.RunOptions): ``precision`` runs the
    replica function under that policy's autocast on the replica's device."""

    precision: str | Policy | None = None
