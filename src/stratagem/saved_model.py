"""``tf.saved_model.save`` / ``load`` for torch models: ``torch.export`` programs with serving signatures."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratagem.train.export import LoadOptions, SaveOptions, check_options

__all__ = ["LoadOptions", "LoadedModel", "SaveOptions", "load", "save"]


def save(
    obj: nn.Module,
    export_dir: str | os.PathLike[str],
    signatures: Any = None,
    options: Any = None,
    *,
    sample_input: Any = None,
    dynamic_batch: bool = True,
) -> None:
    """Save ``obj`` for serving (TensorFlow's ``tf.saved_model.save``): a directory holding one
    ``torch.export`` program per endpoint and a manifest, loaded by ``load`` without the model's code.

    ``signatures``: None (the model's ``forward`` as ``serve``, with ``serving_default`` naming
    it, as a Keras model's SavedModel has them), a callable (the ``serving_default`` signature), or
    a dict of name -> callable (the model, a submodule or a method of the model). Each is traced on
    ``sample_input`` (a tensor, a tuple of positional inputs, a dict of keyword inputs, or a dict of
    those by signature name; default: zeros of the shape ``model.build`` was given), the batch
    dimension left dynamic unless ``dynamic_batch=False``. Under a strategy every replica calls it;
    the chief writes."""
    check_options(options, SaveOptions, "saved_model.save")
    from stratagem.train.export import save_model

    save_model(obj, export_dir, signatures, sample_input, dynamic_batch)


class _Signature:
    """One endpoint, called as TensorFlow calls a loaded function: ``serve(x)`` returns what the
    model returned; a signature (``signatures[name](x)``) a dict of named outputs."""

    def __init__(self, name: str, module: nn.Module, spec: Mapping[str, Any], as_dict: bool) -> None:
        self.name, self.module, self.spec, self.as_dict = name, module, dict(spec), as_dict
        self.structured_input_signature = spec.get("inputs")
        self.structured_outputs = spec.get("outputs")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(_tensor(a) for a in args)
        kwargs = {k: _tensor(v) for k, v in kwargs.items()}
        out = self.module(*args, **kwargs)
        if not self.as_dict:
            return out
        if isinstance(out, Mapping):
            return dict(out)
        if isinstance(out, (tuple, list)):
            return {f"output_{i}": v for i, v in enumerate(out)}
        return {"output_0": out}

    def __repr__(self) -> str:
        return f"<signature {self.name!r}: inputs {self.structured_input_signature}, outputs {self.structured_outputs}>"


def _tensor(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(value))
        return t.float() if t.dtype == torch.float64 else t
    return value


class LoadedModel:
    """What ``load`` returns: each endpoint as an attribute (``loaded.serve(x)``), the signatures
    in ``loaded.signatures`` (``loaded.signatures["serving_default"](x)`` gives a dict of outputs,
    ``output_0``, ... or the model's own keys), and calling it calls ``serving_default``."""

    def __init__(self, endpoints: dict[str, _Signature], signatures: dict[str, _Signature], path: Path) -> None:
        self._endpoints = endpoints
        self.signatures = signatures
        self.path = path
        for name, fn in endpoints.items():
            if name.isidentifier() and not hasattr(type(self), name) and name not in self.__dict__:
                setattr(self, name, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        default = self.signatures.get("serving_default")
        fn = self._endpoints.get(default.name) if default is not None else next(iter(self._endpoints.values()))
        assert fn is not None
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<stratagem.saved_model {str(self.path)!r}: endpoints {list(self._endpoints)}, signatures {list(self.signatures)}>"


def load(export_dir: str | os.PathLike[str], tags: Any = None, options: Any = None) -> LoadedModel:
    """Load what ``save`` (or ``model.export``) wrote (TensorFlow's ``tf.saved_model.load``): the
    programs run without the model's code, on the device they were exported on."""
    del tags  # TensorFlow's MetaGraph tags; a saved_model here has one graph per endpoint
    check_options(options, LoadOptions, "saved_model.load")
    from stratagem.train.export import FORMAT, MANIFEST

    path = Path(export_dir)
    manifest_file = path / MANIFEST
    if path.is_file() and path.suffix == ".pt2":
        program = torch.export.load(path)
        fn = _Signature("serve", program.module(), {}, as_dict=False)
        return LoadedModel({"serve": fn}, {"serving_default": _Signature("serve", fn.module, {}, True)}, path)
    if not manifest_file.exists():
        raise FileNotFoundError(
            f"saved_model.load: {path} is not a saved model written by stratagem.saved_model.save or "
            f"model.export (no {MANIFEST} in it)"
        )
    manifest = json.loads(manifest_file.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"saved_model.load: {manifest_file} is not a {FORMAT} manifest")
    endpoints: dict[str, _Signature] = {}
    modules: dict[str, nn.Module] = {}
    for name, spec in manifest["endpoints"].items():
        modules[name] = torch.export.load(path / spec["file"]).module()
        endpoints[name] = _Signature(name, modules[name], spec, as_dict=False)
    signatures = {
        sig: _Signature(target, modules[target], manifest["endpoints"][target], as_dict=True)
        for sig, target in manifest.get("signatures", {}).items()
    }
    return LoadedModel(endpoints, signatures, path)
