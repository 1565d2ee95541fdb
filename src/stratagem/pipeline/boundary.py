"""What crosses a stage boundary: a tensor, or a tuple / list / dict of tensors (hidden states
with an attention mask, say), flattened into one tensor of shape ``[batch, n]`` (the carrier) plus
a layout (pure data, sent once per step) that unflattens it on the next stage.

The floating-point entries (they must share one dtype, the carrier's) are laid side by side in
the carrier, so the gradient of the carrier is the gradient of each of them: the runtime moves one
activation and one gradient per micro-batch, as for a single tensor. The other entries (integer or
boolean masks, positions: no gradient) travel as their bytes, reinterpreted as carrier elements;
the gradient of their columns is zero. A single tensor is not flattened (no layout: the message is
the same as before).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

# the structure of a boundary value: ("tensor", i) | ("none",) | ("tuple", (s, ...)) |
# ("list", (s, ...)) | ("dict", ((key, s), ...))
Structure = tuple[Any, ...]


@dataclass(frozen=True)
class Entry:
    """One tensor of a boundary value: its dimensions after the batch, its dtype, and whether it
    rides in the carrier as values (floating point: differentiable) or as bytes."""

    shape: tuple[int, ...]
    dtype: str  # "float32", "int64", ...
    as_values: bool

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def columns(self, carrier: torch.dtype) -> int:
        """How many carrier elements per example this entry takes."""
        if self.as_values:
            return self.numel()
        size = torch.empty((), dtype=carrier).element_size()
        nbytes = self.numel() * torch.empty((), dtype=self.torch_dtype()).element_size()
        return -(-nbytes // size)


@dataclass(frozen=True)
class Layout:
    """How a carrier unflattens into the value a stage produced (pure data; ``encode`` /
    ``decode`` are its wire form)."""

    structure: Structure
    entries: tuple[Entry, ...]
    carrier: str

    def encode(self) -> bytes:
        data = {
            "structure": self.structure,
            "entries": [[list(e.shape), e.dtype, e.as_values] for e in self.entries],
            "carrier": self.carrier,
        }
        return json.dumps(data, separators=(",", ":")).encode("utf-8")

    @staticmethod
    def decode(data: bytes) -> Layout:
        d = json.loads(data.decode("utf-8"))
        entries = tuple(Entry(tuple(int(n) for n in s), str(t), bool(v)) for s, t, v in d["entries"])
        return Layout(_tuples(d["structure"]), entries, str(d["carrier"]))

    def describe(self) -> str:
        """The value's structure with each tensor's trailing shape: ``{'h': [*, 16] (float32), ...}``."""
        return _describe(self.structure, lambda i: _entry_text(self.entries[i], "*"))


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _entry_text(e: Entry, batch: str) -> str:
    return f"[{', '.join([batch, *map(str, e.shape)])}] ({e.dtype})"


def _describe(s: Structure, leaf: Any) -> str:
    kind = s[0]
    if kind == "tensor":
        return str(leaf(s[1]))
    if kind == "none":
        return "None"
    if kind == "dict":
        return "{" + ", ".join(f"{k!r}: {_describe(c, leaf)}" for k, c in s[1]) + "}"
    inner = ", ".join(_describe(c, leaf) for c in s[1])
    return f"({inner}{',' if len(s[1]) == 1 else ''})" if kind == "tuple" else f"[{inner}]"


def _flatten(value: Any, leaves: list[torch.Tensor], where: str) -> Structure:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return ("tensor", len(leaves) - 1)
    if value is None:
        return ("none",)
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: a dict crossing a stage boundary must have string keys, got {k!r}")
            items.append((k, _flatten(v, leaves, f"{where}[{k!r}]")))
        return ("dict", tuple(items))
    if isinstance(value, (tuple, list)):
        kind = "list" if isinstance(value, list) else "tuple"
        return (kind, tuple(_flatten(v, leaves, f"{where}[{n}]") for n, v in enumerate(value)))
    raise TypeError(
        f"{where} is a {type(value).__name__}; what crosses a stage boundary must be a tensor, or "
        "tuples, lists and dicts (string keys) of tensors and None"
    )


def describe(value: Any) -> str:
    """A boundary value's structure and shapes, for error messages."""
    leaves: list[torch.Tensor] = []
    try:
        s = _flatten(value, leaves, "the value")
    except TypeError:
        return type(value).__name__
    return _describe(s, lambda i: f"{list(leaves[i].shape)} ({_dtype_name(leaves[i].dtype)})")


def flatten(value: Any, where: str = "the output") -> tuple[torch.Tensor, Layout | None]:
    """``value`` as one carrier tensor ``[batch, n]`` and its layout; a tensor is returned as is
    (layout None). Differentiable in the floating-point entries."""
    if isinstance(value, torch.Tensor):
        return value, None
    leaves: list[torch.Tensor] = []
    structure = _flatten(value, leaves, where)
    if not leaves:
        raise TypeError(f"{where} holds no tensor ({describe(value)}); a stage must pass at least one tensor on")
    batch = None
    for t in leaves:
        if t.dim() == 0 or (batch is not None and t.shape[0] != batch):
            raise ValueError(
                f"{where} is {describe(value)}: every tensor crossing a stage boundary must have the "
                "micro-batch as its first dimension (the same size for all)"
            )
        batch = t.shape[0]
    assert batch is not None
    floats = {t.dtype for t in leaves if t.is_floating_point()}
    if len(floats) > 1:
        raise TypeError(
            f"{where} is {describe(value)}: the floating-point tensors crossing a stage boundary "
            "must share one dtype (their gradients travel together); cast them to one"
        )
    carrier = floats.pop() if floats else torch.uint8
    entries = tuple(Entry(tuple(t.shape[1:]), _dtype_name(t.dtype), t.is_floating_point()) for t in leaves)
    parts = []
    for t, e in zip(leaves, entries):
        if e.as_values:
            parts.append(t.reshape(batch, -1))
            continue
        raw = t.detach().contiguous().reshape(batch, -1).view(torch.uint8)
        cols = e.columns(carrier)
        pad = cols * torch.empty((), dtype=carrier).element_size() - raw.shape[1]
        if pad:
            raw = torch.cat([raw, raw.new_zeros(batch, pad)], dim=1)
        parts.append(raw.view(carrier))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out, Layout(structure, entries, _dtype_name(carrier))


def unflatten(carrier: torch.Tensor, layout: Layout) -> Any:
    """The value ``flatten`` made ``carrier`` from (views of it: differentiable in the
    floating-point entries)."""
    batch = carrier.shape[0]
    cdtype = getattr(torch, layout.carrier)
    want = sum(e.columns(cdtype) for e in layout.entries)
    if carrier.dim() != 2 or carrier.shape[1] != want or carrier.dtype != cdtype:
        raise ValueError(
            f"a stage boundary carrier of {list(carrier.shape)} ({_dtype_name(carrier.dtype)}) does "
            f"not fit its layout {layout.describe()} ([*, {want}] ({layout.carrier}))"
        )
    leaves = []
    start = 0
    for e in layout.entries:
        cols = e.columns(cdtype)
        part = carrier[:, start : start + cols]
        start += cols
        if e.as_values:
            leaves.append(part.reshape(batch, *e.shape))
            continue
        dtype = e.torch_dtype()
        nbytes = e.numel() * torch.empty((), dtype=dtype).element_size()
        raw = part.detach().contiguous().view(torch.uint8)[:, :nbytes].contiguous()
        leaves.append(raw.view(dtype).reshape(batch, *e.shape))
    return _build(layout.structure, leaves)


def _build(s: Structure, leaves: list[torch.Tensor]) -> Any:
    kind = s[0]
    if kind == "tensor":
        return leaves[s[1]]
    if kind == "none":
        return None
    if kind == "dict":
        return {k: _build(c, leaves) for k, c in s[1]}
    items = [_build(c, leaves) for c in s[1]]
    return items if kind == "list" else tuple(items)


def encode(layout: Layout | None) -> bytes:
    """The wire form of a layout (empty: a plain tensor)."""
    return b"" if layout is None else layout.encode()


def decode(data: bytes) -> Layout | None:
    return Layout.decode(data) if data else None
