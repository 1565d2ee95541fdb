"""Nested element structures: flatten, rebuild, describe and measure tuples/dicts of leaves."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch


def flatten(element: Any) -> list[Any]:
    """Leaves of a nested tuple/dict element, in a stable order (dict keys sorted)."""
    if isinstance(element, tuple):
        return [leaf for item in element for leaf in flatten(item)]
    if isinstance(element, dict):
        return [leaf for key in sorted(element) for leaf in flatten(element[key])]
    return [element]


def pack_as(template: Any, leaves: list[Any]) -> Any:
    """Rebuild ``template``'s structure from ``leaves`` (the inverse of :func:`flatten`)."""
    # a module-level recursion, not a closure calling itself: that closure would be a reference
    # cycle holding the leaves (the batch's tensors) until Python's garbage collector ran
    return _build(template, iter(leaves))


def _build(node: Any, it: Iterator[Any]) -> Any:
    if isinstance(node, tuple):
        items = [_build(item, it) for item in node]
        return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
    if isinstance(node, dict):
        return {key: _build(node[key], it) for key in sorted(node)}
    return next(it)


def map_structure(fn: Callable[..., Any], *elements: Any) -> Any:
    """Apply ``fn`` leaf-wise over elements of the same structure."""
    flats = [flatten(e) for e in elements]
    if any(len(f) != len(flats[0]) for f in flats):
        raise ValueError(
            f"elements have different structures: {[describe(e) for e in elements]}"
        )
    return pack_as(elements[0], [fn(*leaves) for leaves in zip(*flats)])


def shape_of(leaf: Any) -> tuple[int, ...]:
    """The shape of a leaf (a Python scalar or string has shape ())."""
    if isinstance(leaf, torch.Tensor | np.ndarray):
        return tuple(leaf.shape)
    return ()


def describe(element: Any) -> str:
    """A compact description of an element's structure and shapes, for error messages."""
    if isinstance(element, tuple):
        return "(" + ", ".join(describe(e) for e in element) + ")"
    if isinstance(element, dict):
        return "{" + ", ".join(f"{k!r}: {describe(element[k])}" for k in sorted(element)) + "}"
    if isinstance(element, torch.Tensor):
        return f"tensor{list(element.shape)}:{str(element.dtype).replace('torch.', '')}"
    if isinstance(element, np.ndarray):
        return f"ndarray{list(element.shape)}:{element.dtype}"
    return type(element).__name__


def nbytes(element: Any) -> int:
    """Approximate memory held by an element's leaves."""
    total = 0
    for leaf in flatten(element):
        if isinstance(leaf, torch.Tensor):
            total += leaf.element_size() * leaf.nelement()
        elif isinstance(leaf, np.ndarray):
            total += leaf.nbytes
        elif isinstance(leaf, str | bytes):
            total += len(leaf) + 49
        else:
            total += 32
    return total


def to_json(value: Any) -> Any:
    """A nested value (tensors, arrays, numbers, strings, bytes, tuples, dicts, lists) as JSON
    values, exactly invertible by :func:`from_json` (for iterator states that hold elements)."""
    if isinstance(value, torch.Tensor):
        return {"t": str(value.dtype).replace("torch.", ""), "s": list(value.shape),
                "v": value.reshape(-1).tolist()}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return {"o": [to_json(v) for v in value.reshape(-1)], "s": list(value.shape)}
        return {"n": value.dtype.str, "s": list(value.shape),
                "v": [to_json(v) for v in value.reshape(-1).tolist()]}
    if isinstance(value, np.generic):
        return {"g": value.dtype.str, "v": to_json(value.item())}
    if isinstance(value, bool | int | float | str) or value is None:
        if isinstance(value, float) and not np.isfinite(value):
            return {"f": repr(value)}
        return value
    if isinstance(value, bytes):
        return {"b": value.hex()}
    if isinstance(value, tuple):
        fields = getattr(value, "_fields", None)
        if fields is not None:
            raise TypeError("namedtuples cannot be stored in an iterator state; use a dict")
        return {"u": [to_json(v) for v in value]}
    if isinstance(value, list):
        return {"l": [to_json(v) for v in value]}
    if isinstance(value, dict):
        return {"d": [[to_json(k), to_json(v)] for k, v in value.items()]}
    to_state = getattr(value, "to_state", None)
    if to_state is not None:  # Ragged
        return {"r": to_state()}
    raise TypeError(f"cannot store a {type(value).__name__} in an iterator state")


def from_json(obj: Any) -> Any:
    """The inverse of :func:`to_json`."""
    if not isinstance(obj, dict):
        return obj
    if "t" in obj:
        dtype = getattr(torch, obj["t"])
        return torch.tensor(obj["v"], dtype=dtype).reshape(obj["s"])
    if "o" in obj:
        out = np.empty(len(obj["o"]), dtype=object)
        out[:] = [from_json(v) for v in obj["o"]]
        return out.reshape(obj["s"])
    if "n" in obj:
        return np.array([from_json(v) for v in obj["v"]], dtype=np.dtype(obj["n"])).reshape(
            obj["s"]
        )
    if "g" in obj:
        return np.dtype(obj["g"]).type(from_json(obj["v"]))
    if "f" in obj:
        return float(obj["f"])
    if "b" in obj:
        return bytes.fromhex(obj["b"])
    if "u" in obj:
        return tuple(from_json(v) for v in obj["u"])
    if "l" in obj:
        return [from_json(v) for v in obj["l"]]
    if "d" in obj:
        return {from_json(k): from_json(v) for k, v in obj["d"]}
    if "r" in obj:
        from stratagem.data.ragged import Ragged

        return Ragged.from_state(obj["r"])
    raise ValueError(f"not a stored value: {obj!r}")


def flatten_up_to(template: Any, value: Any, what: str) -> list[Any]:
    """``value``'s entries at the leaves of ``template``'s structure (tf.data's
    ``flatten_up_to``): an entry may itself be a list or tuple (a shape). A ValueError names
    both structures when they differ."""

    def walk(t: Any, v: Any) -> list[Any]:
        if isinstance(t, tuple):
            if not isinstance(v, tuple | list) or len(v) != len(t):
                raise _mismatch(template, value, what)
            return [leaf for ti, vi in zip(t, v) for leaf in walk(ti, vi)]
        if isinstance(t, dict):
            if not isinstance(v, dict) or sorted(v) != sorted(t):
                raise _mismatch(template, value, what)
            return [leaf for k in sorted(t) for leaf in walk(t[k], v[k])]
        return [v]

    return walk(template, value)


def _mismatch(template: Any, value: Any, what: str) -> ValueError:
    return ValueError(
        f"{what} {value!r} does not match the structure of the elements "
        f"{describe(template)}; give one entry per component, in the same tuple/dict structure"
    )


def text_array(leaves: list[Any]) -> np.ndarray:
    """A batch of text leaves: ``str`` as a numpy unicode array, ``bytes`` as an object array
    (a fixed-width ``S`` array would drop trailing zero bytes, e.g. of serialized records)."""
    items = [x if isinstance(x, str | bytes) else np.asarray(x).item() if np.ndim(x) == 0
             else x for x in leaves]
    if any(isinstance(x, bytes) for x in items):
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out
    return np.asarray(items)


# -- tf's conversion of Python values to tensors (tf.convert_to_tensor / normalize_element) --
_INT32 = (-(1 << 31), (1 << 31) - 1)


def _pure_python(value: Any) -> bool:
    """Whether a (nested) list holds only Python numbers (tf then picks its Python defaults:
    float32, int32; numpy or torch values inside keep their dtype)."""
    if isinstance(value, list | tuple):
        return all(_pure_python(v) for v in value)
    return isinstance(value, bool | int | float | complex) and not isinstance(value, np.generic)


def _is_text_list(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return bool(value) and all(_is_text_list(v) for v in value)
    return isinstance(value, str | bytes | np.str_ | np.bytes_)


def to_tensor(leaf: Any) -> Any:
    """One leaf as tf.data holds it (``tf.convert_to_tensor``): a torch tensor for numbers
    (Python ``int`` -> int32, or int64 when a value does not fit int32; ``float`` -> float32;
    ``bool`` -> bool; a list -> one tensor; numpy values keep their dtype, float64 included);
    text stays ``str``/``bytes`` (a list of text: a numpy array, ``bytes`` as objects);
    tensors and other objects (Ragged, sparse, images) are returned as they are."""
    if isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, np.generic):  # before float: np.float64 is a float
        if leaf.dtype.kind in "SUO":
            return leaf.item()
        return torch.from_numpy(np.asarray(leaf).copy())
    if isinstance(leaf, bool):
        return torch.tensor(leaf)
    if isinstance(leaf, int):
        dtype = torch.int32 if _INT32[0] <= leaf <= _INT32[1] else torch.int64
        return torch.tensor(leaf, dtype=dtype)
    if isinstance(leaf, float):
        return torch.tensor(leaf, dtype=torch.float32)
    if isinstance(leaf, complex):
        return torch.tensor(leaf, dtype=torch.complex128)
    if isinstance(leaf, np.ndarray):
        return _from_numpy(leaf)
    if isinstance(leaf, list):
        return _list_to_tensor(leaf)
    return leaf


def _from_numpy(arr: np.ndarray) -> Any:
    if arr.dtype.kind not in "biufc":
        return arr  # text and object arrays stay numpy (tf.string)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(np.ascontiguousarray(arr))


def _list_to_tensor(value: list) -> Any:
    if _is_text_list(value):
        return text_array(value) if np.ndim(np.asarray(value, dtype=object)) == 1 else (
            np.asarray(value))
    if value and all(isinstance(v, torch.Tensor) for v in value):
        shapes = {tuple(v.shape) for v in value}
        if len(shapes) == 1:
            return torch.stack(list(value))
    try:
        arr = np.asarray([v.numpy() if isinstance(v, torch.Tensor) else v for v in value])
    except ValueError as e:  # numpy >= 1.24 refuses ragged lists
        raise ValueError(
            f"cannot convert a non-rectangular Python list to a tensor (as tf.convert_to_tensor "
            f"cannot): {_short(value)}; use a tuple for a structure of separate components, "
            "equal-length rows, or padded_batch/ragged_batch later"
        ) from e
    if arr.dtype == object:
        raise ValueError(
            f"cannot convert a non-rectangular Python list to a tensor (as tf.convert_to_tensor "
            f"cannot): {_short(value)}; use a tuple for a structure of separate components, "
            "equal-length rows, or padded_batch/ragged_batch later"
        )
    if _pure_python(value):
        if arr.dtype.kind == "f":
            arr = arr.astype(np.float32)
        elif arr.dtype.kind in "iu" and (arr.size == 0 or (
                arr.min() >= _INT32[0] and arr.max() <= _INT32[1])):
            arr = arr.astype(np.int32)
        elif arr.dtype.kind == "c":
            arr = arr.astype(np.complex128)
    return _from_numpy(arr)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def normalize(element: Any) -> Any:
    """An element as tf.data holds it (``structure.normalize_element``): tuples, namedtuples
    and dicts stay structure, every leaf goes through :func:`to_tensor` (a Python list is one
    tensor, not a structure)."""
    if isinstance(element, tuple):
        items = [normalize(e) for e in element]
        return type(element)(*items) if hasattr(element, "_fields") else tuple(items)
    if isinstance(element, dict):
        return {k: normalize(v) for k, v in element.items()}
    return to_tensor(element)


def normalize_output(value: Any) -> Any:
    """What a ``map`` function returned, as tf.data takes it: a top-level list is a tuple (tf
    treats it as separate components, not one stacked tensor), then :func:`normalize`."""
    if isinstance(value, list):
        value = tuple(value)
    return normalize(value)
