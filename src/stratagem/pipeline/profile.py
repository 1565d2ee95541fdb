"""Per-layer costs for balancing: parameter counts, or measured forward+backward time on a sample
micro-batch (layers on the meta device are materialized one at a time, then dropped)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from stratagem.pipeline.materialize import _fill, _meta_modules, _reset


def param_costs(layers: list[tuple[str, nn.Module]]) -> list[float]:
    """Number of parameter elements of each layer (works on the meta device)."""
    return [float(sum(p.numel() for p in m.parameters())) for _, m in layers]


def time_costs(
    layers: list[tuple[str, nn.Module]], sample: Any, *, repeats: int = 3, warmup: int = 1
) -> list[float]:
    """Seconds of forward+backward of each layer on ``sample`` (the input of the first layer),
    the best of ``repeats`` runs; gradients and the RNG are left as they were."""
    costs = []
    h = sample
    with torch.random.fork_rng():
        for _, layer in layers:
            metas = _meta_modules(layer)
            was_meta = bool(metas)
            if was_meta:
                _fill(layer)
                with torch.no_grad():
                    for m in metas:
                        _reset(m)
            grads = [(p, p.grad) for p in layer.parameters()]
            best = float("inf")
            out: Any = None
            for r in range(warmup + repeats):
                x = h.detach().requires_grad_(h.is_floating_point()) if isinstance(h, torch.Tensor) else h
                t0 = time.perf_counter()
                out = layer(x)
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.backward(torch.ones_like(out))
                dt = time.perf_counter() - t0
                if r >= warmup:
                    best = min(best, dt)
            for p, g in grads:
                p.grad = g
            costs.append(best)
            h = out.detach() if isinstance(out, torch.Tensor) else out
            if was_meta:
                layer.to("meta")
    return costs

