"""Export a model for serving on ``torch.export``: programs that run without the model's code."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ExportError", "MANIFEST", "export", "export_programs", "write"]

#: the file naming a saved_model directory's endpoints and signatures
MANIFEST = "saved_model.json"
FORMAT = "stratagem.saved_model"


class _IOOptions:
    """TensorFlow's ``SaveOptions`` / ``LoadOptions``: ``experimental_io_device`` is where the
    files are read and written. A stratagem process always reads and writes on its own host, so
    ``"/job:localhost"`` (TF's distribution tutorial's) is what happens anyway; another device is
    an error naming it."""

    def __init__(self, experimental_io_device: str | None = None, **other: Any) -> None:
        if other:
            raise TypeError(f"{type(self).__name__}: {sorted(other)} have no meaning here; only experimental_io_device is taken")
        device = experimental_io_device
        if device is not None and not str(device).startswith("/job:localhost"):
            raise ValueError(
                f"{type(self).__name__}(experimental_io_device={device!r}): stratagem reads and writes on the host of "
                "the process that calls it; use '/job:localhost' or leave it unset"
            )
        self.experimental_io_device = device


class SaveOptions(_IOOptions):
    """``tf.saved_model.SaveOptions(experimental_io_device="/job:localhost")``."""


class LoadOptions(_IOOptions):
    """``tf.saved_model.LoadOptions(experimental_io_device="/job:localhost")``."""


def check_options(options: Any, kind: type, what: str) -> None:
    """``options`` must be None or a ``kind`` (its meaning is checked when it is made)."""
    if options is not None and not isinstance(options, kind):
        raise TypeError(f"{what}(options=...) takes stratagem.saved_model.{kind.__name__}; got {type(options).__name__}")


class ExportError(ValueError):
    """A model (or one of its operations) cannot be captured by ``torch.export``."""


def _batch_doubled(t: torch.Tensor) -> torch.Tensor:
    """A batch of one as a batch of two (``torch.export`` would take a size of 1 as a constant)."""
    return torch.cat([t, t]) if t.dim() and t.shape[0] == 1 else t


def _as_args(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample input as the call's positional and keyword arguments."""
    if isinstance(sample, Mapping):
        return (), {str(k): _tensor(v) for k, v in sample.items()}
    if isinstance(sample, (tuple, list)):
        return tuple(_tensor(v) for v in sample), {}
    return (_tensor(sample),), {}


def _tensor(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(value))
        return t.float() if t.dtype == torch.float64 else t
    return value


def _dynamic(args: tuple[Any, ...], kwargs: dict[str, Any], batch: Any) -> Any:
    def spec(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {0: batch} if v.dim() else None
        if isinstance(v, (tuple, list)):
            return type(v)(spec(x) for x in v)
        if isinstance(v, Mapping):
            return {k: spec(x) for k, x in v.items()}
        return None

    if kwargs:
        return {k: spec(v) for k, v in kwargs.items()}
    return tuple(spec(a) for a in args)


def _doubled(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return _batch_doubled(v)
    if isinstance(v, (tuple, list)):
        return type(v)(_doubled(x) for x in v)
    if isinstance(v, Mapping):
        return {k: _doubled(x) for k, x in v.items()}
    return v


class _Call(nn.Module):
    """A function of the model (a method other than ``forward``) as a module to export."""

    def __init__(self, model: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _where(model: nn.Module, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` (an export) with the submodule being traced tracked, so an error names it."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []

    def enter(m: nn.Module, args: Any) -> None:
        stack.append(f"{names.get(id(m)) or '(the model)'} ({type(m).__name__})")

    def leave(m: nn.Module, args: Any, out: Any) -> None:
        if stack:
            stack.pop()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]
    try:
        return fn()
    except Exception as e:
        raise _explain(model, e, list(stack)) from e
    finally:
        for h in handles:
            h.remove()


def _explain(model: nn.Module, e: Exception, stack: list[str]) -> ExportError:
    text = str(e)
    call = re.search(r"The following call raised this error:\n(.*?)(?:\n\n|\Z)", text, re.S)
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    where = f" in module {stack[-1]}" if stack else ""
    what = f"{type(e).__name__}: {first}"
    details = [ln for ln in text.splitlines() if ln.startswith("  - ")][:3]  # torch's reasons
    if details:
        what += "\n" + "\n".join(details)
    if call:
        what += "\n  at:\n" + call.group(1).rstrip()
    if "data-dependent" in text or "GuardOnDataDependent" in type(e).__name__:
        advice = ("a Python branch or loop on a tensor's values (`if x.sum() > 0:`, `.item()`, `.tolist()`) "
                  "cannot be captured; rewrite it with torch.where or torch.cond, or compute it outside the model")
    elif "Constraint" in type(e).__name__ or "specializ" in text:
        advice = ("the model's code fixes the batch size (a reshape to a constant batch, a check of "
                  "x.shape[0]); make it follow x.shape[0], or export with dynamic_batch=False")
    else:
        advice = "rewrite that construct in torch operations, or see torch.export's documentation of this error"
    return ExportError(
        f"export: {type(model).__name__} cannot be exported by torch.export{where}: {what}\n"
        f"What to do: {advice}."
    )


def export_programs(
    model: nn.Module, signatures: Any = None, sample_input: Any = None, dynamic_batch: bool = True,
) -> dict[str, torch.export.ExportedProgram]:
    """``torch.export`` programs of ``model``, one per endpoint: ``{"serve": forward}`` by default,
    or the ``signatures`` (a callable, or a dict of name -> callable: the model, a submodule or a
    method of it). The batch dimension (dimension 0 of every input) is dynamic unless
    ``dynamic_batch=False``. ``sample_input``: a tensor, a tuple of positional inputs or a dict of
    keyword inputs (a dict of those per signature name); default zeros of ``model.build``'s shape."""
    if any(type(t).__name__ == "DTensor" for t in [*model.parameters(), *model.buffers()]):
        raise ExportError(
            f"export: {type(model).__name__} holds sharded parameters (DTensors: ShardedStrategy or a layout "
            "map); export is not offered for them yet: save with model.save, load the weights into a model "
            "made outside any sharding strategy, and export that"
        )
    if signatures is None:
        endpoints: dict[str, Any] = {"serve": model}
    elif isinstance(signatures, Mapping):
        endpoints = dict(signatures)
    else:
        endpoints = {"serving_default": signatures}
    programs: dict[str, torch.export.ExportedProgram] = {}
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        for name, fn in endpoints.items():
            sample = sample_input.get(name) if isinstance(sample_input, Mapping) and name in sample_input else sample_input
            if sample is None:
                shape = model.__dict__.get("_sg_input_shape")
                if shape is None:
                    raise ValueError(
                        f"export: endpoint {name!r} needs a sample input to trace the model with: pass "
                        "sample_input=x (a batch as the model takes it), or call model.build(input_shape) first"
                    )
                from stratagem.train.model_api import sample_inputs

                sample = sample_inputs(model, shape, model.__dict__.get("_sg_input_dtype"))
            args, kwargs = _as_args(sample)
            module = fn if isinstance(fn, nn.Module) else _Call(model, fn)
            if not callable(fn):
                raise TypeError(f"export: signature {name!r} must be a callable (the model or a method of it); got {fn!r}")
            dynamic = None
            if dynamic_batch:
                args, kwargs = _doubled(args), _doubled(kwargs)
                dynamic = _dynamic(args, kwargs, torch.export.Dim("batch"))
                if isinstance(module, _Call):  # forward(*args, **kwargs): one entry per parameter
                    dynamic = {"args": _dynamic(args, {}, torch.export.Dim("batch"))}
                    if kwargs:
                        dynamic["kwargs"] = _dynamic((), kwargs, torch.export.Dim("batch"))
            programs[name] = _where(model, functools.partial(torch.export.export, module, args, kwargs, dynamic_shapes=dynamic))
    finally:
        for m, mode in modes:
            m.training = mode
    return programs


def _describe(program: torch.export.ExportedProgram, dynamic: bool) -> dict[str, Any]:
    """The endpoint's inputs and outputs (shapes, None for the batch) for the manifest."""
    import torch.utils._pytree as pytree

    def meta(node: Any) -> Any:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = [d if isinstance(d, int) else None for d in val.shape]
            return {"shape": shape, "dtype": str(val.dtype).replace("torch.", "")}
        return None

    graph = program.graph_module.graph
    user_inputs = set(program.graph_signature.user_inputs)
    inputs = [meta(n) for n in graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    out_node = next(n for n in graph.nodes if n.op == "output")
    outputs = [meta(n) for n in pytree.tree_leaves(out_node.args[0]) if hasattr(n, "meta")]
    outputs = outputs[-len(program.graph_signature.user_outputs):] if program.graph_signature.user_outputs else outputs
    return {"inputs": inputs, "outputs": outputs}


def write(programs: Mapping[str, torch.export.ExportedProgram], export_dir: Path, dynamic_batch: bool) -> None:
    """A saved_model directory: one ``.pt2`` per endpoint and the manifest (written to a staging
    directory, then renamed into place)."""
    staging = export_dir.parent / f".staging-{export_dir.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    endpoints = {}
    for name, program in programs.items():
        file = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.pt2"
        torch.export.save(program, staging / file)
        endpoints[name] = {"file": file, **_describe(program, dynamic_batch)}
    signatures = {"serving_default": "serve"} if "serve" in programs and "serving_default" not in programs else {}
    signatures.update({n: n for n in programs if n != "serve"})
    manifest = {"format": FORMAT, "version": 1, "torch": torch.__version__, "endpoints": endpoints,
                "signatures": signatures}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
    if export_dir.exists():
        shutil.rmtree(export_dir) if export_dir.is_dir() else export_dir.unlink()
    os.replace(staging, export_dir)


def _strategy_of(model: nn.Module) -> Any:
    from stratagem.distribute.current import get_strategy
    from stratagem.distribute.ownership import strategy_of

    return strategy_of(model) or get_strategy()


def _agree_failed(strategy: Any, failed: bool) -> bool:
    """Whether any replica failed (every replica gets the same answer)."""
    from stratagem.distribute.strategy import Execution

    if strategy.num_replicas_in_sync == 1 or strategy.extended.execution is Execution.COORDINATED:
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    return bool(strategy.reduce("sum", flag).item())


def save_model(
    model: nn.Module, export_dir: str | os.PathLike[str], signatures: Any = None, sample_input: Any = None,
    dynamic_batch: bool = True, single_file: bool = False,
) -> dict[str, torch.export.ExportedProgram]:
    """Trace ``model`` on every replica and write the artifact on the chief (the others wait)."""
    strategy = _strategy_of(model)
    programs = export_programs(model, signatures, sample_input, dynamic_batch)
    path = Path(export_dir)
    error: BaseException | None = None
    if strategy.extended.should_checkpoint:
        try:
            if single_file:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.export.save(next(iter(programs.values())), path)
            else:
                write(programs, path, dynamic_batch)
        except BaseException as e:  # told to every replica below, raised here
            error = e
    failed = _agree_failed(strategy, error is not None)
    strategy.barrier()
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"export: the chief failed to write {path}; see its error")
    return programs


def export(
    model: nn.Module,
    filepath: str | os.PathLike[str],
    *,
    format: str | None = None,
    verbose: bool | None = None,
    input_signature: Any = None,
    sample_input: Any = None,
    dynamic_batch: bool = True,
) -> None:
    """Keras 3's ``model.export(filepath)`` on ``torch.export``: a serving artifact with a ``serve``
    endpoint (the model's ``forward``), loaded and called without the model's code.

    ``format``: ``"saved_model"`` (the default; a directory, loaded by
    ``stratagem.saved_model.load(filepath)``: ``loaded.serve(x)``,
    ``loaded.signatures["serving_default"](x)``), or ``"pt2"`` (the default when ``filepath`` ends
    with ``.pt2``: one ``torch.export.save`` file, ``torch.export.load(filepath).module()(x)``).
    The batch dimension is dynamic (any batch size serves) unless ``dynamic_batch=False``.
    ``sample_input`` (or Keras's ``input_signature``, a list of sample tensors) is a batch as the
    model takes it; without one, zeros of the shape ``model.build`` was given. Under a strategy
    every replica calls it; the chief writes. A model ``torch.export`` cannot capture raises
    ``ExportError`` naming the submodule and the construct."""
    fmt = format or ("pt2" if str(filepath).endswith(".pt2") else "saved_model")
    if fmt not in ("saved_model", "pt2"):
        raise ValueError(
            f"export: format={format!r} is not offered; stratagem exports torch.export programs: "
            "format='saved_model' (a directory for stratagem.saved_model.load) or 'pt2' (one file for "
            "torch.export.load). TensorFlow, ONNX and OpenVINO artifacts are Keras's other backends' formats"
        )
    if input_signature is not None:
        if sample_input is not None:
            raise ValueError("export: give sample_input or input_signature, not both")
        sample_input = tuple(input_signature) if isinstance(input_signature, (list, tuple)) else input_signature
    programs = save_model(model, filepath, None, sample_input, dynamic_batch, single_file=fmt == "pt2")
    if verbose is not False:
        from stratagem.distribute.process import print as chief_print

        chief_print(_endpoints_text(filepath, programs, dynamic_batch))


def _endpoints_text(filepath: Any, programs: Mapping[str, torch.export.ExportedProgram], dynamic: bool) -> str:
    lines = [f"Saved artifact at '{filepath}'. The following endpoints are available:", ""]
    for name, program in programs.items():
        info = _describe(program, dynamic)
        lines.append(f"* Endpoint '{name}'")
        for i, spec in enumerate(info["inputs"]):
            lines.append(f"  args_{i} (POSITIONAL_ONLY): {_spec_text(spec)}")
        lines.append("Output Type:")
        for spec in info["outputs"]:
            lines.append(f"  {_spec_text(spec)}")
    return "\n".join(lines)


def _spec_text(spec: Any) -> str:
    if not isinstance(spec, dict):
        return repr(spec)
    shape = ", ".join("None" if d is None else str(d) for d in spec["shape"])
    shape = f"({shape},)" if len(spec["shape"]) == 1 else f"({shape})"
    return f"TensorSpec(shape={shape}, dtype=torch.{spec['dtype']})"
