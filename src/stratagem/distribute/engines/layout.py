"""Layouts, Keras 3 style: a LayoutMap of parameter-path patterns over a DeviceMesh
(``core/mesh.py``), and the tensor-parallel plan (pure) they give a model.

``LayoutMap`` keys are regular expressions matched (``re.search``) against parameter paths
(``blocks.0.attn.q.weight``); values are layouts, one mesh axis name (or None) per tensor
dimension, as in ``keras.distribution.LayoutMap``. A linear layer's weight is ``(out, in)`` in
torch: ``("model", None)`` splits its output features (column-parallel, Megatron's first
matmul), ``(None, "model")`` its input features (row-parallel, the second, followed by one
all-reduce). :func:`tensor_parallel_plan` turns the matches into ``{module path: "colwise" |
"rowwise"}``; parameters no key matches are replicated.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from stratagem.core.mesh import DeviceMesh

__all__ = ["DeviceMesh", "Layout", "LayoutMap", "is_conv1d", "tensor_parallel_plan"]

Layout = tuple[str | None, ...]


class LayoutMap:
    """Parameter-path patterns -> layouts (the first pattern that matches wins, in insertion order)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self._items: dict[str, Layout] = {}

    def __setitem__(self, pattern: str, layout: Sequence[str | None]) -> None:
        lay = tuple(layout)
        bad = [a for a in lay if a is not None and a not in self.mesh.axis_names]
        if bad:
            raise ValueError(f"LayoutMap[{pattern!r}] = {lay}: axes {bad} are not in the mesh {self.mesh.axis_names}")
        re.compile(pattern)
        self._items[pattern] = lay

    def __getitem__(self, path: str) -> Layout | None:
        """The layout of the parameter at ``path`` (None: replicated)."""
        for pattern, layout in self._items.items():
            if re.search(pattern, path):
                return layout
        return None

    def items(self) -> Iterator[tuple[str, Layout]]:
        return iter(self._items.items())

    def __repr__(self) -> str:
        return f"LayoutMap({dict(self._items)!r})"


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2, GPT): a linear layer whose weight is stored (in, out)
    and applied as ``addmm(bias, x, weight)``; known by its class name and attributes, so that
    transformers need not be imported."""
    w = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2
        and tuple(w.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))
    )  # fmt: skip


def tensor_parallel_plan(model: nn.Module, layout_map: LayoutMap, axis: str = "model", prefix: str = "") -> dict[str, str]:
    """``{module path: "colwise" | "rowwise"}`` for the linear and embedding layers whose weight
    the map splits along ``axis``; an error for a layout this cannot express. ``prefix``: what
    goes before ``model``'s parameter names in the names the map's patterns match (a pipeline
    stage's layer: its name in the whole model)."""
    plan: dict[str, str] = {}
    for path, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False)]
        for name, p in own:
            full = f"{prefix}{path}.{name}" if path else f"{prefix}{name}"
            layout = layout_map[full]
            if layout is None or axis not in layout:
                continue
            if len(layout) != p.dim():
                raise ValueError(f"LayoutMap: {full} has {p.dim()} dimensions but its layout {layout} has {len(layout)}")
            conv1d = is_conv1d(module)
            if not (isinstance(module, (nn.Linear, nn.Embedding)) or conv1d) or name != "weight" or p.dim() != 2:
                raise ValueError(
                    f"LayoutMap: {full} ({type(module).__name__}.{name}) is split along {axis!r}, but only "
                    "the weights of Linear and Embedding layers (and Hugging Face's Conv1D) can be; leave it replicated"
                )
            split = layout.index(axis)
            # a Linear weight is (out, in): split out -> colwise; an Embedding's (num, dim) and a
            # Conv1D's (in, out): dim / out -> colwise
            col = split == 0 if isinstance(module, nn.Linear) else split == 1
            plan[path] = "colwise" if col else "rowwise"
    return plan
