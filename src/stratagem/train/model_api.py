"""Keras's everyday model API on a torch module: summary, weights, layers, trainable, build, export."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import nn

__all__ = ["ModelAPI", "apply_trainable", "effective_trainable", "model_weights", "record_input", "summary_text"]

#: a parameter or buffer of an nn.Lazy* layer before its first batch (no shape yet)
_Uninitialized: Any = getattr(nn.parameter, "UninitializedTensorMixin")  # noqa: B009

#: set on a parameter that ``trainable = False`` froze (so ``trainable = True`` thaws only those)
_FROZEN = "_sg_frozen_by_trainable"


# --- weights ------------------------------------------------------------------------------------
def _weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, nn.Module, bool]]:
    """``(name, tensor, owner, is_parameter)`` for every parameter and persistent buffer of
    ``module``, in ``state_dict()`` order (module by module, each one's parameters then its
    buffers), each tensor once (a tied weight under its first name)."""
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, p in owner._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield dot + name, p, owner, True
        for name, b in owner._buffers.items():
            if b is not None and name not in owner._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                yield dot + name, b, owner, False


def model_weights(module: nn.Module) -> list[torch.Tensor]:
    """Keras's ``weights`` of a torch module: its parameters and persistent buffers, in
    ``state_dict()`` order, each once."""
    return [t for _, t, _, _ in _weights(module)]


def _frozen_modules(root: nn.Module) -> set[int]:
    """The ids of the modules under ``root`` that are not trainable: ``trainable`` is False on
    them or on a module above them (a parent's False overrides its children's True, as in Keras,
    where a non-trainable layer has no trainable weights whatever its sublayers say)."""
    frozen: set[int] = set()

    def walk(m: nn.Module, parent_frozen: bool) -> None:
        here = parent_frozen or getattr(m, "trainable", True) is False
        if here:
            frozen.add(id(m))
        for child in m.children():
            walk(child, here)

    walk(root, False)
    return frozen


def effective_trainable(module: nn.Module) -> dict[int, bool]:
    """For each parameter of ``module`` (by id): whether training updates it: it requires grad and
    no module that owns it, or is above its owner, has ``trainable = False``."""
    frozen = _frozen_modules(module)
    out: dict[int, bool] = {}
    for _, t, owner, is_param in _weights(module):
        if is_param:
            out[id(t)] = bool(t.requires_grad) and id(owner) not in frozen
    return out


def apply_trainable(module: nn.Module) -> None:
    """Apply every submodule's ``trainable`` attribute to its parameters' ``requires_grad``.

    A parameter under a module with ``trainable = False`` (its own or any above it: a parent's
    False overrides) gets ``requires_grad = False``; one this function froze before whose modules
    are all trainable again gets ``requires_grad = True``. A parameter a user froze directly
    (``p.requires_grad_(False)``) stays frozen. Called by ``fit`` and ``evaluate``; plain torch
    submodules (``nn.Linear``) take ``layer.trainable = False`` as a plain attribute, which this
    turns into frozen parameters. Frozen batch-norm layers run in inference mode (see ``ModelAPI.train``)."""
    frozen = _frozen_modules(module)
    for _, t, owner, is_param in _weights(module):
        if not is_param:
            continue
        if id(owner) in frozen:
            if t.requires_grad:
                t.requires_grad_(False)
                setattr(t, _FROZEN, True)
        elif getattr(t, _FROZEN, False):
            t.requires_grad_(True)
            delattr(t, _FROZEN)


def _frozen_batch_norms(root: nn.Module) -> Iterator[nn.Module]:
    frozen = _frozen_modules(root)
    for m in root.modules():
        if id(m) in frozen and isinstance(m, nn.modules.batchnorm._NormBase):
            yield m


def record_input(module: nn.Module, x: Any) -> None:
    """Remember the input shape of ``x`` (a tensor or array, or a tuple or list of them: the
    positional inputs) as ``build`` does, the batch dimension as None, unless the model was built
    with a shape already: what Keras's first ``fit`` / ``predict`` does for a subclassed model, so
    ``summary()`` then shows output shapes and ``export()`` needs no sample input. Other inputs (a
    dict, a dataset) are not recorded."""
    if module.__dict__.get("_sg_input_shape") is not None:
        return
    items = list(x) if isinstance(x, (tuple, list)) else [x]
    if not items or not all(isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim >= 1 for v in items):
        return
    shapes = [(None, *(int(d) for d in v.shape[1:])) for v in items]
    dtypes = {v.dtype if isinstance(v, torch.Tensor) else torch.from_numpy(np.zeros(0, v.dtype)).dtype for v in items}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    if dtype == torch.float64:
        dtype = torch.float32  # arrays are taken as float32, Keras's floatx
    module.__dict__["_sg_input_shape"] = shapes if isinstance(x, (tuple, list)) else shapes[0]
    module.__dict__["_sg_input_dtype"] = dtype


# --- the properties a module's own attribute of the same name shadows ---------------------------
class _Shadowable:
    """A property that gives way to a module's own parameter, buffer, submodule or attribute of the
    same name: a model with ``self.layers = nn.ModuleList(...)`` (most transformers) keeps its
    ``layers``; the property answers only where the module has none."""

    def __init__(self, getter: Callable[[Any], Any], setter: Callable[[Any, Any], None] | None = None) -> None:
        self.getter, self.setter = getter, setter
        self.__doc__ = getter.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        for store in ("_parameters", "_buffers", "_modules"):
            found = obj.__dict__.get(store, {})
            if self.name in found:
                return found[self.name]
        if self.name in obj.__dict__:
            return obj.__dict__[self.name]
        return self.getter(obj)

    def __set__(self, obj: Any, value: Any) -> None:
        if self.setter is None or self.name in obj.__dict__:
            obj.__dict__[self.name] = value
        else:
            self.setter(obj, value)

    def __delete__(self, obj: Any) -> None:
        obj.__dict__.pop(self.name, None)


def _set_trainable(obj: Any, value: Any) -> None:
    """Keras's ``layer.trainable = value``: set on the module and every module under it (so a later
    ``model.trainable = True`` thaws what a ``layer.trainable = False`` froze, as in Keras), then
    applied to the parameters' ``requires_grad``."""
    if not isinstance(value, bool):
        raise TypeError(f"trainable must be True or False, got {value!r}")
    for m in cast(nn.Module, obj).modules():
        if isinstance(type(m).__dict__.get("trainable"), _Shadowable) or isinstance(m, ModelAPI):
            m.__dict__["_sg_trainable"] = value
        else:
            object.__setattr__(m, "trainable", value)
    apply_trainable(cast(nn.Module, obj))


def _get_trainable(obj: Any) -> bool:
    return bool(obj.__dict__.get("_sg_trainable", True))


def _layers(obj: Any) -> list[nn.Module]:
    """The model's direct submodules, in order (Keras's ``model.layers``)."""
    return list(cast(nn.Module, obj).children())


def _variables(module: nn.Module, keep: Callable[[torch.Tensor], bool]) -> list[Any]:
    from stratagem.train.variables import Variable

    return [Variable(t, name) for name, t, _, _ in _weights(module) if keep(t)]


def _all_weights(obj: Any) -> list[Any]:
    """Every parameter and persistent buffer as a ``Variable`` (``v.value`` the tensor itself,
    ``v.path`` its ``state_dict`` name), in ``state_dict()`` order, each once (Keras's
    ``model.weights``: trainable and non-trainable, layer by layer)."""
    return _variables(cast(nn.Module, obj), lambda t: True)


def _trainable_weights(obj: Any) -> list[Any]:
    """The parameters that training updates, as ``Variable``s in ``state_dict()`` order: requiring
    grad, and under no module with ``trainable = False`` (Keras's ``trainable_weights``)."""
    module = cast(nn.Module, obj)
    live = effective_trainable(module)
    return _variables(module, lambda t: live.get(id(t), False))


def _non_trainable_weights(obj: Any) -> list[Any]:
    """The frozen parameters and the persistent buffers (BatchNorm's running statistics), as
    ``Variable``s in ``state_dict()`` order (Keras's ``non_trainable_weights``)."""
    module = cast(nn.Module, obj)
    live = effective_trainable(module)
    return _variables(module, lambda t: not live.get(id(t), False))


# --- summary ------------------------------------------------------------------------------------
def _snake(name: str) -> str:
    s = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", s).lower()


def _model_name(module: nn.Module) -> str:
    name = module.__dict__.get("name", getattr(type(module), "name", None))
    return name if isinstance(name, str) else _snake(type(module).__name__)


def _numel(t: torch.Tensor) -> int:
    return 0 if isinstance(t, _Uninitialized) else t.numel()


def _nbytes(t: torch.Tensor) -> int:
    return 0 if isinstance(t, _Uninitialized) else t.numel() * t.element_size()


def readable_size(n: float) -> str:
    """Keras's memory size: ``18.79 KB`` (units of 1024)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n / 1024 < 1:
            return f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PB"


class _Shape(tuple):  # type: ignore[type-arg]
    """One tensor's shape in a module's output (None: a dimension that follows the batch)."""


def _format_shape(value: Any) -> str:
    if isinstance(value, _Shape):
        return "(" + ", ".join(str(d) for d in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_format_shape(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        parts = ", ".join(_format_shape(v) for v in value)
        return f"[{parts}]" if isinstance(value, list) else f"({parts},)" if len(value) == 1 else f"({parts})"
    return "?"


def _shape_tree(value: Any) -> Any:
    """The shapes in a module's output (tensors' shapes; tuples, lists, dicts kept), else None."""
    if isinstance(value, torch.Tensor):
        return _Shape(value.shape)
    if isinstance(value, dict) or (hasattr(value, "items") and hasattr(value, "keys")):
        return {k: _shape_tree(v) for k, v in value.items() if isinstance(v, (torch.Tensor, tuple, list, dict))}
    if isinstance(value, list):
        return [_shape_tree(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_shape_tree(v) for v in value)
    return None


def _merge_batch(a: Any, b: Any) -> Any:
    """Two runs' shapes (batch 2 and batch 3) as one, a dimension that changed with the batch
    shown as None (Keras's symbolic batch dimension)."""
    if isinstance(a, _Shape) and isinstance(b, _Shape) and len(a) == len(b):
        return _Shape(x if x == y else None for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge_batch(a[k], b.get(k)) for k in a}
    if isinstance(a, (list, tuple)) and not isinstance(a, _Shape) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return type(a)(_merge_batch(x, y) for x, y in zip(a, b))
    return a


def _input_dtype(module: nn.Module, dtype: Any) -> torch.dtype:
    if dtype is not None:
        return getattr(torch, dtype) if isinstance(dtype, str) else cast(torch.dtype, dtype)
    for m in module.modules():  # the first layer with weights decides: an embedding takes indices
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            return torch.long
        if next(iter(m._parameters.values()), None) is not None:
            break
    for t in module.parameters():
        if t.is_floating_point() and not isinstance(t, _Uninitialized):
            return t.dtype
    return torch.get_default_dtype()


def _device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        if not isinstance(t, _Uninitialized) and t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def sample_inputs(module: nn.Module, input_shape: Any, dtype: Any = None, batch: int = 2) -> tuple[Any, ...]:
    """Zeros of ``input_shape`` (Keras's: the batch dimension first, None for any batch size, taken
    as ``batch``), one tensor per shape when it is a list of shapes, as positional arguments."""
    if isinstance(input_shape, dict):
        raise ValueError("input_shape as a dict is not offered; give a shape, or a list of shapes (one per positional input)")
    shapes = list(input_shape) if input_shape and isinstance(input_shape[0], (tuple, list, torch.Size)) else [input_shape]
    dt, device = _input_dtype(module, dtype), _device(module)
    out = []
    for shape in shapes:
        dims = [batch if d is None else int(d) for d in shape]
        out.append(torch.zeros(dims, dtype=dt, device=device))
    return tuple(out)


def output_shapes(module: nn.Module, input_shape: Any, dtype: Any = None) -> dict[int, Any]:
    """Each submodule's output shapes (by id) on zeros of ``input_shape``: two forward passes, in
    eval mode and without grad (batches of 2 and 3; a dimension that follows the batch is None,
    as in Keras; dimensions given in ``input_shape`` are kept)."""
    runs: list[dict[int, Any]] = []
    fixed_batch = input_shape and not isinstance(input_shape[0], (tuple, list, torch.Size)) and input_shape[0] is not None
    for batch in ((2,) if fixed_batch else (2, 3)):
        seen: dict[int, Any] = {}

        def hook(m: nn.Module, args: Any, out: Any, seen: dict[int, Any] = seen) -> None:
            seen[id(m)] = _shape_tree(out)

        handles = [m.register_forward_hook(hook) for m in module.modules()]
        was = [(m, m.training) for m in module.modules()]
        try:
            module.eval()
            with torch.no_grad():
                try:
                    module(*sample_inputs(module, input_shape, dtype, batch))
                except Exception as e:
                    raise ValueError(
                        f"the model failed on zeros of input_shape {input_shape!r} ({type(e).__name__}: {e}); give "
                        "the shape as the model takes its input, batch dimension first (a list of shapes for several "
                        "positional inputs), and dtype= when it takes other than floats"
                    ) from e
        finally:
            for h in handles:
                h.remove()
            for m, mode in was:
                m.training = mode
        runs.append(seen)
    if len(runs) == 1:
        return runs[0]
    return {k: _merge_batch(v, runs[1].get(k)) for k, v in runs[0].items()}


def _wrap(text: str, width: int) -> list[str]:
    """``text`` wrapped at spaces to ``width`` (a word longer than the width cut with an ellipsis,
    as Keras's table does)."""
    lines: list[str] = []
    for para in text.split("\n"):
        line = ""
        words = re.findall(r"\S+\s*", para) or [""]
        words[0] = para[: len(para) - len(para.lstrip())] + words[0]  # an indent is kept
        for word in words:
            if line and len((line + word).rstrip()) > width:
                lines.append(line.rstrip())
                line = ""
            line += word
        lines.append(line.rstrip())
    return [ln if len(ln) <= width else ln[: max(width - 1, 0)] + "…" for ln in lines]


def _justify(text: str, width: int, how: str) -> str:
    if how == "right":
        return text.rjust(width)
    if how == "center":
        left = (width - len(text)) // 2
        return " " * left + text + " " * (width - len(text) - left)
    return text.ljust(width)


def _table(header: list[str], rows: list[list[str]], widths: list[int], align: list[str]) -> list[str]:
    """Keras's summary table (rich's heavy-head box, a line between rows); ``widths`` include
    each cell's one space of padding either side."""
    inner = [w - 2 for w in widths]

    def line(left: str, fill: str, mid: str, right: str) -> str:
        return left + mid.join(fill * w for w in widths) + right

    def cells(values: list[str], edge: str, bottom: bool) -> list[str]:
        wrapped = [_wrap(v, w) for v, w in zip(values, inner)]
        height = max(len(c) for c in wrapped)
        padded = [([""] * (height - len(c)) + c) if bottom else (c + [""] * (height - len(c))) for c in wrapped]
        return [
            edge + edge.join(" " + _justify(padded[j][i], inner[j], align[j]) + " " for j in range(len(values))) + edge
            for i in range(height)
        ]

    out = [line("┏", "━", "┳", "┓"), *cells(header, "┃", True), line("┡", "━", "╇", "┩")]
    for i, row in enumerate(rows):
        if i:
            out.append(line("├", "─", "┼", "┤"))
        out.extend(cells(row, "│", False))
    out.append(line("└", "─", "┴", "┘"))
    return out


def _column_widths(positions: Sequence[float], line_length: int, n: int) -> list[int]:
    """Keras's column widths for ``line_length`` (positions relative, or absolute when the last is
    above 1), then reduced evenly to fit the borders, as Keras's table does."""
    if positions[-1] > 1:
        positions = [p / positions[-1] for p in positions]
    widths, current = [], 0
    for pos in positions:
        width = int(pos * line_length) - current
        if width < 4:
            raise ValueError("Insufficient console width to print summary.")
        widths.append(width)
        current += width
    widths = [w + 2 for w in widths]  # each cell's padding
    excess = sum(widths) - (line_length - (n + 1))
    remaining, ratio = excess, len(widths)
    for i, w in enumerate(widths):
        if remaining <= 0:
            break
        take = min(w, round(remaining / ratio))
        widths[i] = w - take
        remaining -= take
        ratio -= 1
    return widths


def summary_text(
    model: nn.Module,
    line_length: int | None = None,
    positions: Sequence[float] | None = None,
    expand_nested: bool = False,
    show_trainable: bool = False,
    layer_range: Sequence[str] | None = None,
    input_shape: Any = None,
    dtype: Any = None,
) -> str:
    """Keras's ``model.summary()`` as text (see ``ModelAPI.summary``)."""
    if input_shape is None:
        input_shape = model.__dict__.get("_sg_input_shape")
        dtype = dtype if dtype is not None else model.__dict__.get("_sg_input_dtype")
    shapes = output_shapes(model, input_shape, dtype) if input_shape is not None else {}
    live = effective_trainable(model)
    frozen = _frozen_modules(model)

    header = ["Layer (type)", "Output Shape", "Param #"]
    align = ["left", "left", "right"]
    default = 88
    positions = list(positions or [0.45, 0.80, 1.0])
    if show_trainable:
        default += 12
        positions = [p * 0.90 for p in positions] + [1.0]
        header.append("Trainable")
        align.append("center")
    line_length = line_length or min(default, shutil.get_terminal_size().columns - 4)
    widths = _column_widths(positions, line_length, len(header))

    def fields(name: str, layer: nn.Module, prefix: str) -> list[str]:
        weights = list(_weights(layer))
        count = sum(_numel(t) for _, t, _, _ in weights)
        unbuilt = any(isinstance(t, _Uninitialized) for _, t, _, _ in weights)
        shape = _format_shape(shapes[id(layer)]) if id(layer) in shapes else "?"
        row = [f"{prefix}{name} ({type(layer).__name__})", shape, f"{count:,}" + (" (unbuilt)" if unbuilt else "")]
        if show_trainable:
            params = [t for _, t, _, is_param in weights if is_param]
            if not weights:
                row.append("-")
            elif params:
                row.append("Y" if any(live.get(id(t), False) for t in params) else "N")
            else:
                row.append("N" if id(layer) in frozen else "Y")
        return row

    def rows_of(name: str, layer: nn.Module, level: int) -> list[list[str]]:
        out = [fields(name, layer, "   " * level + "└ " if level else "")]
        if expand_nested:
            for child_name, child in layer.named_children():
                out.extend(rows_of(child_name, child, level + 1))
        return out

    children = list(model.named_children())
    if layer_range is not None:
        children = _layer_range(children, layer_range)
    rows = [r for name, layer in children for r in rows_of(name, layer, 0)]

    weights = model_weights(model)
    trainable = [t for t in weights if live.get(id(t), False)]
    non_trainable = [t for t in weights if not live.get(id(t), False)]
    opt_state = _optimizer_state(model)
    count = lambda ts: sum(_numel(t) for t in ts)  # noqa: E731
    size = lambda ts: readable_size(sum(_nbytes(t) for t in ts))  # noqa: E731
    lines = [f'Model: "{_model_name(model)}"', *_table(header, rows, widths, align)]
    lines.append(f" Total params: {count(weights) + count(opt_state):,} ({size(weights + opt_state)})")
    lines.append(f" Trainable params: {count(trainable):,} ({size(trainable)})")
    lines.append(f" Non-trainable params: {count(non_trainable):,} ({size(non_trainable)})")
    if opt_state:
        lines.append(f" Optimizer params: {count(opt_state):,} ({size(opt_state)})")
    return "\n".join(lines) + "\n"


def _layer_range(children: list[tuple[str, nn.Module]], layer_range: Sequence[str]) -> list[tuple[str, nn.Module]]:
    if len(layer_range) != 2:
        raise ValueError(f"layer_range must be a list or tuple of two names, got {list(layer_range)!r}")
    names = [n for n, _ in children]
    first = [i for i, n in enumerate(names) if re.match(layer_range[0], n)]
    last = [i for i, n in enumerate(names) if re.match(layer_range[1], n)]
    if not first or not last:
        raise ValueError(f"layer_range {list(layer_range)!r} matches no layer; the layers are {names}")
    return children[first[0] : last[-1] + 1]


def _optimizer_state(model: nn.Module) -> list[torch.Tensor]:
    """The compiled optimizer's state tensors once it has stepped (Keras prints them as
    "Optimizer params" once its optimizer is built)."""
    optimizer = getattr(type(model), "optimizer", None) and getattr(model, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


# --- the mixin -----------------------------------------------------------------------------------
class ModelAPI:
    """Keras's everyday model methods for an ``nn.Module`` (``stratagem.Model`` has them):
    ``summary``, ``count_params``, ``get_weights`` / ``set_weights``, ``get_layer``, ``layers``,
    ``weights`` / ``trainable_weights`` / ``non_trainable_weights``, ``trainable``, ``build`` and
    ``export``. See docs/FIT.md, "The model API and export"."""

    layers = _Shadowable(_layers)
    weights = _Shadowable(_all_weights)
    trainable_weights = _Shadowable(_trainable_weights)
    non_trainable_weights = _Shadowable(_non_trainable_weights)
    trainable = _Shadowable(_get_trainable, _set_trainable)

    def _as_module(self) -> nn.Module:
        return cast(nn.Module, self)

    @property
    def trainable_variables(self) -> list[Any]:
        """Keras's alias of ``trainable_weights``."""
        return cast(list[Any], self.trainable_weights)

    @property
    def non_trainable_variables(self) -> list[Any]:
        """Keras's alias of ``non_trainable_weights``."""
        return cast(list[Any], self.non_trainable_weights)

    def train(self, mode: bool = True) -> Any:
        """``nn.Module.train``, with Keras's rule for frozen batch norm: a BatchNorm under a module
        with ``trainable = False`` runs in inference mode (its running statistics used, not updated)
        even while the model trains, as Keras 3's ``BatchNormalization(trainable=False)`` does."""
        module = self._as_module()
        nn.Module.train(module, mode)
        if mode:
            for bn in _frozen_batch_norms(module):
                bn.training = False
        return module

    def count_params(self) -> int:
        """The number of weights: parameters and persistent buffers (BatchNorm's running mean and
        variance, and torch's ``num_batches_tracked`` counter), each tied tensor once."""
        return sum(_numel(t) for t in model_weights(self._as_module()))

    def get_weights(self) -> list[np.ndarray]:
        """Every weight as a numpy array, in ``weights``' order (``state_dict()`` order: module by
        module, each one's parameters then its persistent buffers). Under ShardedStrategy every
        replica calls it (a sharded weight is gathered whole)."""
        from stratagem.core.whole import whole_tensor

        return [whole_tensor(t).detach().cpu().numpy().copy() for t in model_weights(self._as_module())]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Set every weight from arrays in ``get_weights()``' order; the count and every shape must match."""
        module = self._as_module()
        named = [(n, t) for n, t, _, _ in _weights(module)]
        if len(weights) != len(named):
            raise ValueError(
                f"set_weights: the model has {len(named)} weights ({', '.join(n for n, _ in named[:6])}"
                f"{', ...' if len(named) > 6 else ''}), but {len(weights)} arrays were given; give one per "
                "weight in get_weights() order"
            )
        values = [torch.as_tensor(np.asarray(w)) if not isinstance(w, torch.Tensor) else w for w in weights]
        for (name, t), v in zip(named, values):
            if tuple(v.shape) != tuple(t.shape):
                raise ValueError(
                    f"set_weights: weight {name!r} has shape {tuple(t.shape)}, but the array given for it has "
                    f"shape {tuple(v.shape)}"
                )
        with torch.no_grad():
            for (_, t), v in zip(named, values):
                v = v.to(dtype=t.dtype)
                if type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor":
                    from stratagem.train.checkpoint.dtensors import _like

                    v = _like(v, t)  # this process's shard of it
                t.copy_(v)

    def get_layer(self, name: str | None = None, index: int | None = None) -> nn.Module:
        """A layer by name (a direct submodule's name, ``"0"`` in a Sequential, or a dotted path
        to a nested one, ``"encoder.0"``) or by index into ``layers``."""
        module = self._as_module()
        if name is not None and index is not None:
            raise ValueError(f"Provide only a layer name or a layer index. Received: index={index}, name={name}.")
        children = list(module.named_children())
        if index is not None:
            if not -len(children) <= index < len(children):
                raise ValueError(
                    f"Was asked to retrieve layer at index {index} but model only has {len(children)} layers."
                )
            return children[index][1]
        if name is None:
            raise ValueError("Provide either a layer name or layer index at `get_layer`.")
        try:
            return module.get_submodule(str(name))
        except AttributeError:
            raise ValueError(
                f"No such layer: {name}. Existing layers are: {[n for n, _ in children]} (a nested layer by "
                "its dotted path, as named_modules() names it)."
            ) from None

    def build(self, input_shape: Any, dtype: Any = None) -> None:
        """Keras's ``build(input_shape)``: run the model once on zeros of ``input_shape`` (the batch
        dimension first, None for any; a list of shapes for several inputs), which materializes
        ``nn.Lazy*`` layers (call it inside the strategy's scope), and remember the shape, so
        ``summary()`` shows output shapes and ``export()`` needs no sample input. ``dtype``: the
        inputs' (default: the parameters'; indices for a model that starts with an embedding)."""
        module = self._as_module()
        modes = [(m, m.training) for m in module.modules()]
        try:
            module.eval()
            with torch.no_grad():
                module(*sample_inputs(module, input_shape, dtype))
        finally:
            for m, mode in modes:
                m.training = mode
        module.__dict__["_sg_input_shape"] = input_shape
        module.__dict__["_sg_input_dtype"] = dtype

    def summary(
        self,
        line_length: int | None = None,
        positions: Sequence[float] | None = None,
        print_fn: Callable[..., Any] | None = None,
        expand_nested: bool = False,
        show_trainable: bool = False,
        layer_range: Sequence[str] | None = None,
        *,
        input_shape: Any = None,
        dtype: Any = None,
    ) -> None:
        """Print Keras's summary table: each layer (the direct submodules; ``expand_nested``: theirs
        too) with its output shape and weight count, then the total, trainable and non-trainable
        counts with their sizes (and the optimizer's state once it has stepped, as Keras prints).

        Output shapes need a forward pass: they come from zeros of ``input_shape`` (this call's, or
        the one ``build`` was given), else show ``?``, as Keras shows an unbuilt model's.
        ``print_fn`` gets the whole text in one call, as Keras 3 gives it; without it the chief
        prints it (once per job, not once per replica)."""
        text = summary_text(
            self._as_module(), line_length, positions, expand_nested, show_trainable, layer_range,
            input_shape=input_shape, dtype=dtype,
        )
        if print_fn is not None:
            print_fn(text)
            return
        from stratagem.distribute.process import print as chief_print

        chief_print(text, end="")

    def export(
        self,
        filepath: str | os.PathLike[str],
        format: str | None = None,
        verbose: bool | None = None,
        input_signature: Any = None,
        *,
        sample_input: Any = None,
        dynamic_batch: bool = True,
    ) -> None:
        """Keras 3's ``model.export(filepath)``: a serving artifact on ``torch.export`` that runs
        without the model's code (see ``stratagem.train.export.export``)."""
        from stratagem.train.export import export

        export(
            self._as_module(), filepath, format=format, verbose=verbose, input_signature=input_signature,
            sample_input=sample_input, dynamic_batch=dynamic_batch,
        )
