"""Build this stage's layers from a model that may live on the meta device: flatten nested
``nn.Sequential``, replay the initialisation of every layer in order from the RNG state the model
was built with (other stages' layers are materialized one at a time and dropped again), and keep
only the local layers, so each process holds only its own stage and the result equals the
initialisation of the unsplit model built from the same seed."""

from __future__ import annotations

from collections.abc import Container, Iterator

import torch
from torch import nn

from stratagem.pipeline.errors import PipelineConfigError


def flatten(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The layers of an ``nn.Sequential`` with nested Sequentials flattened, with their names."""
    if not isinstance(model, nn.Sequential):
        raise PipelineConfigError(
            f"strategy.pipeline needs an nn.Sequential (layers run one after another), got "
            f"{type(model).__name__}; wrap your layers in nn.Sequential(...)"
        )
    out: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        full = f"{prefix}{name}"
        if isinstance(child, nn.Sequential):
            out.extend(flatten(child, full + "."))
        else:
            out.append((full, child))
    return out


def _direct(m: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    for k, p in m._parameters.items():
        if p is not None:
            yield k, p, True
    for k, b in m._buffers.items():
        if b is not None:
            yield k, b, False


def has_meta(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in module.parameters()) or any(
        t.device.type == "meta" for t in module.buffers()
    )


def _meta_modules(layer: nn.Module) -> list[nn.Module]:
    """The modules of ``layer`` holding meta tensors, children before parents (the order in
    which their constructors initialised them)."""
    order: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for c in m.children():
            visit(c)
        if any(t.device.type == "meta" for _, t, _ in _direct(m)):
            order.append(m)

    visit(layer)
    return order


def _reset(m: nn.Module) -> None:
    fn = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
    assert fn is not None
    fn()


def check_resettable(layers: list[tuple[str, nn.Module]]) -> None:
    for name, layer in layers:
        for m in _meta_modules(layer):
            if not (hasattr(m, "reset_parameters") or hasattr(m, "_reset_parameters")):
                metas = [k for k, t, _ in _direct(m) if t.device.type == "meta"]
                raise PipelineConfigError(
                    f"layer {name!r} ({type(m).__name__}) has tensors {metas} on the meta device "
                    "but no reset_parameters() to initialise them; give the module a "
                    "reset_parameters() method, or build the model outside strategy.scope() on "
                    "the CPU (each process then briefly holds the whole model)"
                )


def _fill(layer: nn.Module) -> None:
    """Replace meta tensors by uninitialised CPU tensors (in place, keeping requires_grad)."""
    for m in layer.modules():
        for k, t, is_param in list(_direct(m)):
            if t.device.type != "meta":
                continue
            real = torch.empty_like(t, device="cpu")
            if is_param:
                m._parameters[k] = nn.Parameter(real, requires_grad=t.requires_grad)
            else:
                m._buffers[k] = real


def materialize(
    layers: list[tuple[str, nn.Module]],
    owned: Container[int],
    device: torch.device,
    rng_state: torch.Tensor | None,
) -> None:
    """Give the ``owned`` layers real tensors on ``device``; move the others to meta.

    If the model holds meta tensors, every layer's ``reset_parameters`` is replayed in order from
    ``rng_state`` (the CPU generator state the model was built from; None: the current state),
    and the generator is left where building the unsplit model would have left it.
    """
    if any(has_meta(m) for _, m in layers):
        check_resettable(layers)
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        for j, (_, layer) in enumerate(layers):
            metas = _meta_modules(layer)
            if not metas:
                continue
            _fill(layer)
            with torch.no_grad():
                for m in metas:
                    _reset(m)
            if j not in owned:
                layer.to("meta")
    for j, (_, layer) in enumerate(layers):
        if j in owned:
            layer.to(device)
        elif not all(t.device.type == "meta" for t in (*layer.parameters(), *layer.buffers())):
            layer.to("meta")
