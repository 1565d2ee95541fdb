"""The object codec: nested states (tensors, arrays, numbers, strings, containers) to a JSON
structure plus flat tensors, and back, without pickle. Tags mark what JSON cannot say
(``{"__tensor__": "t3"}``, tuples, non-string dict keys, dtypes); anything else is refused."""

from __future__ import annotations

import base64
import os
from typing import Any

import numpy as np
import torch
from torch import nn


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated, altered or not in our format."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(f"checkpoint file {os.fspath(path)} is unusable: {problem}")
        self.path = os.fspath(path)
        self.problem = problem


def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors one (a tied weight: the same storage, offset, shape and strides)."""
    if t.numel() == 0 or t.is_meta or type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except RuntimeError:  # no host-visible storage (an XLA tensor): ties are not looked for
        return None
    return (t.device, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def encode_value(
    value: Any, tensors: dict[str, torch.Tensor], path: str, aliases: dict[tuple[Any, ...], str] | None = None
) -> Any:
    """``value`` as JSON, its tensors added to ``tensors``. A tensor met twice (a tied weight
    under two names of a state dict) is stored once and referenced twice, so it decodes to one
    tensor under both names."""
    if aliases is None:
        aliases = {}
    if isinstance(value, torch.Tensor):
        alias = _alias_key(value)
        if alias is not None and alias in aliases:
            return {"__tensor__": aliases[alias]}
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        if alias is not None:
            aliases[alias] = key
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": {"dtype": value.dtype.str, "shape": list(value.shape),
                                "data": value.reshape(-1).tolist()}}
    if isinstance(value, np.generic):
        return encode_value(value.item(), tensors, path, aliases)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v, tensors, f"{path}[{i}]", aliases) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, tensors, f"{path}[{i}]", aliases) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {"__dict__": [[encode_value(k, tensors, path, aliases), encode_value(v, tensors, f"{path}.{k}", aliases)]
                             for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).replace("torch.", "")}
    raise TypeError(
        f"cannot checkpoint {path}: a {type(value).__name__}; states may hold tensors, numpy "
        "arrays, numbers, strings, bytes, lists, tuples and dicts"
    )


def decode_value(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [decode_value(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise CheckpointCorruptError(where, f"unexpected object with keys {sorted(value)[:5]}")
    (tag, body), = value.items()
    if tag == "__tensor__":
        if body not in tensors:
            raise CheckpointCorruptError(where, f"tensor {body!r} is missing from its .safetensors")
        return tensors[body]
    if tag == "__ndarray__":
        try:
            dtype = np.dtype(body["dtype"])
            if dtype.kind not in "biufcUS":  # no object or void arrays: plain values only
                raise CheckpointCorruptError(where, f"an array of dtype {dtype} (only numbers, booleans, strings)")
            return np.asarray(body["data"], dtype=dtype).reshape(body["shape"])
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointCorruptError(where, f"an array that cannot be rebuilt ({e})") from None
    if tag == "__bytes__":
        return base64.b64decode(body)
    if tag == "__tuple__":
        return tuple(decode_value(v, tensors, where) for v in body)
    if tag == "__dict__":
        return {decode_value(k, tensors, where): decode_value(v, tensors, where) for k, v in body}
    if tag == "__dtype__":
        dt = getattr(torch, str(body), None)
        if not isinstance(dt, torch.dtype):
            raise CheckpointCorruptError(where, f"unknown dtype {body!r}")
        return dt
    raise CheckpointCorruptError(where, f"unknown tag {tag!r}")
