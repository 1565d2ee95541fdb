"""Mesh layouts, Keras 3 style: a DeviceMesh with named axes, a LayoutMap of parameter-path patterns,
and the tensor-parallel plan (pure) they give a model.

``LayoutMap`` keys are regular expressions matched (``re.search``) against parameter paths
(``blocks.0.attn.q.weight``); values are layouts, one mesh axis name (or None) per tensor
dimension, as in ``keras.distribution.LayoutMap``. A linear layer's weight is ``(out, in)`` in
torch: ``("model", None)`` splits its output features (column-parallel, Megatron's first
matmul), ``(None, "model")`` its input features (row-parallel, the second, followed by one
all-reduce). :func:`tensor_parallel_plan` turns the matches into ``{module path: "colwise" |
"rowwise"}``; parameters no key matches are replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

Layout = tuple[str | None, ...]


@dataclass(frozen=True)
class DeviceMesh:
    """Processes arranged in a grid with named axes: ``DeviceMesh((2, 2), ("data", "model"))``."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "axis_names", tuple(self.axis_names))
        if len(self.shape) != len(self.axis_names):
            raise ValueError(f"DeviceMesh: shape {self.shape} has {len(self.shape)} axes but axis_names {self.axis_names} names {len(self.axis_names)}")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"DeviceMesh: axis names must differ, got {self.axis_names}")
        if any(n < 1 for n in self.shape):
            raise ValueError(f"DeviceMesh: every axis needs at least one process, got shape {self.shape}")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        """The number of processes along ``name`` (1 for an axis the mesh does not have)."""
        return self.shape[self.axis_names.index(name)] if name in self.axis_names else 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where process ``rank`` sits on each axis (row-major, as torch's DeviceMesh)."""
        out = {}
        for name, n in reversed(list(zip(self.axis_names, self.shape))):
            out[name] = rank % n
            rank //= n
        return {name: out[name] for name in self.axis_names}

    def groups(self, axis: str) -> list[list[int]]:
        """The ranks that differ only along ``axis``, one list per group (row-major order)."""
        if axis not in self.axis_names:
            return [[r] for r in range(self.size)]
        found: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.size):
            c = self.coordinates(r)
            key = tuple(v for k, v in c.items() if k != axis)
            found.setdefault(key, []).append(r)
        return list(found.values())


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


def tensor_parallel_plan(model: nn.Module, layout_map: LayoutMap, axis: str = "model") -> dict[str, str]:
    """``{module path: "colwise" | "rowwise"}`` for the linear and embedding layers whose weight
    the map splits along ``axis``; an error for a layout this cannot express."""
    plan: dict[str, str] = {}
    for path, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False)]
        for name, p in own:
            full = f"{path}.{name}" if path else name
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
