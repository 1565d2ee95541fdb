"""Models as Hugging Face writes them: keyword inputs, and outputs that are a mapping.

- **Inputs**: a batch whose ``x`` is a mapping (``{"input_ids": ..., "attention_mask": ...}``)
  is passed as keyword arguments, ``model(**x)``, when the model's ``forward`` takes those names
  (or ``**kwargs``); otherwise ``model(x)`` as for any other ``x``.
- **Outputs**: a model returning a mapping (a ``dict`` or a ``transformers`` ``ModelOutput``)
  hands its ``"logits"`` to the loss function and the metrics (the whole mapping when it has no
  ``"logits"``). With ``loss_fn=None`` the model's own ``"loss"`` is minimized (as Keras uses a
  model's own losses): it is taken to be the mean over the replica's batch, as a scalar returned by
  a loss function is, so it equals one device's when every example weighs alike in it (the
  same number of counted tokens per example; otherwise pass a loss function).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stratagem.core import tree

_KEYWORDS: dict[type, tuple[frozenset[str], bool]] = {}


def _forward_names(model: Any) -> tuple[frozenset[str], bool]:
    """The keyword names ``model``'s forward takes, and whether it takes ``**kwargs``."""
    kind = type(model)
    got = _KEYWORDS.get(kind)
    if got is None:
        fn = model.forward if isinstance(model, nn.Module) else model
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            got = (frozenset(), False)
        else:
            kw = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            got = (frozenset(p.name for p in params if p.kind in kw),
                   any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params))
        _KEYWORDS[kind] = got
    return got


def call_model(model: Any, x: Any) -> Any:
    """``model(**x)`` for a mapping ``x`` whose keys ``model.forward`` takes, else ``model(x)``."""
    if isinstance(x, Mapping) and x and all(isinstance(k, str) for k in x):
        names, var_kw = _forward_names(model)
        if var_kw or all(k in names for k in x):
            return model(**x)
    return model(x)


def predictions(outputs: Any) -> Any:
    """What the loss function and the metrics see: a mapping's ``"logits"`` (else the mapping)."""
    if isinstance(outputs, Mapping) and outputs.get("logits") is not None:
        return outputs["logits"]
    return outputs


def model_loss(outputs: Any, n: int) -> torch.Tensor:
    """The model's own loss (a mapping's ``"loss"``) as ``n`` per-example losses."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
    if not isinstance(loss, torch.Tensor):
        got = f"a mapping with keys {sorted(outputs)}" if isinstance(outputs, Mapping) else type(outputs).__name__
        raise ValueError(
            f"loss_fn=None minimizes the model's own loss, the 'loss' of the mapping it returns; the "
            f"model returned {got}. Give the model its labels (a Hugging Face model computes its "
            "loss when the inputs include labels=...) or pass a loss_fn"
        )
    if loss.dim() == 0:
        return loss.float().expand(n)
    if loss.dim() == 1 and loss.shape[0] == n:
        return loss.float()
    raise ValueError(
        f"the model's 'loss' has shape {tuple(loss.shape)} for a batch of {n} examples; it must be a "
        "scalar (the batch's mean) or one loss per example"
    )


def for_gather(outputs: Any) -> Any:
    """Outputs ``predict`` can concatenate across batches and replicas: a mapping becomes a plain
    dict of its batched tensors (``"logits"``, hidden states); its scalar ``"loss"`` (a batch
    mean), None values and other objects (a Hugging Face key/value cache) are left out."""
    if isinstance(outputs, Mapping):
        return {k: v for k, v in outputs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    return outputs


def examples_in(value: Any) -> int:
    """The leading dimension of the first batched tensor in ``value`` (0 if none)."""
    for t in tree.leaves(value):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return 0
