"""The local stage: its layers, the forward of a micro-batch (kept for backward or to be
recomputed) and the backward -- whole, or split into the input gradient and the weight gradients
(zero-bubble schedules); failures name the stage, the layer and the shapes involved."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from stratagem.core.whole import whole_tensor
from stratagem.pipeline import boundary
from stratagem.pipeline.errors import PipelineError, StageShapeError
from stratagem.pipeline.rematerialize import RNGSnapshot, frozen_buffers, replay_rng
from stratagem.pipeline.timeline import Recorder


def describe(module: nn.Module) -> str:
    """The first line of a module's repr: ``Linear(in_features=5, out_features=8, bias=True)``."""
    text = repr(module).splitlines()
    return text[0].rstrip("(") + ("(...)" if len(text) > 1 else "")


def shape_of(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{list(x.shape)} ({str(x.dtype).replace('torch.', '')})"
    return boundary.describe(x)


@dataclass
class _Saved:
    input: Any
    output: torch.Tensor | None  # None: recompute in backward
    rng: RNGSnapshot | None
    target: Any = None
    scale: float = 1.0
    # split backward: the outputs of the parameter-holding modules, captured in the forward
    # with grad, and after the I pass the gradients of those outputs
    leaves: list[tuple[nn.Module, torch.Tensor]] | None = None
    leaf_grads: list[_WeightPass] | None = None


@dataclass
class _WeightPass:
    """One backward of a W pass: from ``starts`` (module outputs, or edges of autograd nodes the
    I pass ran through) with their gradients to ``params``; ``clamps``: nodes whose incoming
    gradients are pinned to what the I pass saw (so a start below another is not counted
    twice)."""

    starts: list[Any]
    grads: list[torch.Tensor]
    params: list[nn.Parameter]
    clamps: list[tuple[Any, tuple[Any, ...]]]


def _grad_node(t: torch.Tensor) -> Any:
    """The autograd node of ``t``: its grad_fn, or a leaf's gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    fn = t.view_as(t).grad_fn
    return fn.next_functions[0][0] if fn is not None else None


def _graph_groups(out: torch.Tensor, targets: Sequence[torch.Tensor], params: Sequence[nn.Parameter]
                  ) -> tuple[list[tuple[list[Any], list[nn.Parameter]]], list[nn.Parameter]]:  # fmt: skip
    """Weight gradients that need no module output (torch's stage_backward_input/weight): for each
    parameter, the nodes of the graph from ``out`` that the I pass (towards ``targets``) runs and
    from which the parameter is reached without passing another such node. Returns the groups
    (nodes, parameters; parameters sharing a node share a group) and the parameters ``out`` does
    not reach (left to the I pass)."""
    root: Any = out.grad_fn
    if root is None:
        return [], list(params)
    consumers: dict[Any, list[Any]] = {root: []}
    queue = [root]
    while queue:  # the reverse edges of the graph
        node = queue.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in consumers:
                consumers[nxt] = []
                queue.append(nxt)
            consumers[nxt].append(node)
    ran: set[Any] = set()  # the nodes on paths from out to a target: the I pass runs them
    queue = [n for n in map(_grad_node, targets) if n in consumers]
    while queue:
        node = queue.pop()
        if node in ran:
            continue
        ran.add(node)
        queue.extend(consumers[node])
    groups: list[tuple[set[Any], list[nn.Parameter]]] = []
    unreached: list[nn.Parameter] = []
    for p in params:
        acc = _grad_node(p)
        if acc not in consumers:
            unreached.append(p)
            continue
        starts: set[Any] = set()
        seen = {acc}
        queue = [acc]
        while queue:
            for up in consumers[queue.pop()]:
                if up in seen:
                    continue
                seen.add(up)
                if up in ran:
                    starts.add(up)
                else:
                    queue.append(up)
        merged = [g for g in groups if g[0] & starts]
        for g in merged:
            groups.remove(g)
            starts |= g[0]
        groups.append((starts, [q for g in merged for q in g[1]] + [p]))
    return [(list(nodes), ps) for nodes, ps in groups], unreached


def _foreign_uses(out: torch.Tensor, leaves: Sequence[tuple[torch.Tensor, Sequence[nn.Parameter]]]) -> set[int]:
    """The ids of parameters in ``leaves`` that ``out`` also depends on other than through their
    own module's output: a walk of the autograd graph from ``out`` in regions, a new region
    starting at each module output; a parameter met in a region not its module's is foreign."""
    if out.grad_fn is None:  # the output is the input (a stage of identities)
        return set()
    starts = {o.grad_fn: k for k, (o, _) in enumerate(leaves) if o.grad_fn is not None}
    owner = {id(p): k for k, (_, ps) in enumerate(leaves) for p in ps}
    foreign: set[int] = set()
    seen: set[tuple[Any, int]] = set()
    stack: list[tuple[Any, int]] = [(out.grad_fn, -1)]
    while stack:
        node, region = stack.pop()
        region = starts.get(node, region)
        if (node, region) in seen:
            continue
        seen.add((node, region))
        var = getattr(node, "variable", None)
        if var is not None:
            k = owner.get(id(var))
            if k is not None and k != region:
                foreign.add(id(var))
            continue
        stack.extend((nxt, region) for nxt, _ in node.next_functions if nxt is not None)
    return foreign


#: what torch says when a layer cannot take its input's shape or dtype (a Linear's "mat1 and mat2
#: shapes cannot be multiplied", a conv's "expected input[...] to have 3 channels", a norm's
#: "expected input with shape", an embedding's "Expected tensor for argument #1 'indices' to have
#: one of the following scalar types")
_SHAPE_WORDS = re.compile(r"shape|size|dimension|\bdims?\b|channels|mat1|mat2|scalar type|dtype", re.IGNORECASE)


def _rejects_its_input(e: Exception) -> bool:
    """Whether a first layer's error says the input does not fit it (not a failure of its own)."""
    return isinstance(e, (RuntimeError, ValueError, IndexError, TypeError)) and bool(_SHAPE_WORDS.search(str(e)))


class Stage:
    """Stage ``index`` of ``num_stages``: the layers it holds and its micro-batches in flight.

    ``layer_names``/``layer_descriptions`` cover the whole model (every stage knows the
    structure), so an error can name the neighbour's layers too.
    """

    def __init__(
        self,
        index: int,
        num_stages: int,
        layers: Sequence[nn.Module],
        first_layer: int,
        layer_names: Sequence[str],
        layer_descriptions: Sequence[str],
        device: torch.device,
        loss_fn: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.index = index
        self.num_stages = num_stages
        self.layers = list(layers)
        self.module = nn.ModuleList(self.layers)
        self.first_layer = first_layer
        self.layer_names = list(layer_names)
        self.layer_descriptions = list(layer_descriptions)
        self.device = device
        self.loss_fn = loss_fn
        self._saved: dict[int, _Saved] = {}
        self._split = False
        self._capturing: list[tuple[nn.Module, torch.Tensor]] | None = None
        self._hooks: list[Any] = []
        self._w_modules: dict[nn.Module, list[nn.Parameter]] = {}
        self.recorder: Recorder | None = None  # set while the strategy profiles
        # a tuple/dict crossing a boundary travels as one carrier tensor: the layout of what this
        # stage receives (set by the runtime from the step's first message) and of what it sends
        self.boundary_in: boundary.Layout | None = None
        self.boundary_out: boundary.Layout | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def _layer(self, j: int) -> str:
        g = self.first_layer + j
        return f"layer {self.layer_names[g]!r} ({self.layer_descriptions[g]})"

    # --- compute ----------------------------------------------------------------------------
    def _run(self, x: Any, target: Any, scale: float, *, with_loss: bool = True) -> torch.Tensor:
        if not self.is_first and self.boundary_in is not None:
            x = boundary.unflatten(x, self.boundary_in)  # the previous stage's tuple / dict
        h = x
        for j, layer in enumerate(self.layers):
            try:
                h = layer(h)
            except Exception as e:
                if j == 0 and not self.is_first and _rejects_its_input(e):
                    prev = self.first_layer - 1
                    raise StageShapeError(
                        f"stage {self.index} cannot take the activation stage {self.index - 1} "
                        f"sent: received {shape_of(x)} from stage {self.index - 1} (which ends "
                        f"with layer {self.layer_names[prev]!r}, {self.layer_descriptions[prev]}); "
                        f"stage {self.index} starts with {self._layer(0)}: "
                        f"{type(e).__name__}: {e}",
                        stage=self.index,
                    ) from e
                raise PipelineError(
                    f"stage {self.index}, {self._layer(j)} failed on an input of {shape_of(h)}: "
                    f"{type(e).__name__}: {e}",
                    stage=self.index,
                ) from e
        # a split layer's output (pipeline x tensor) whole, as a plain tensor, before it crosses to
        # the next stage or meets the loss (differentiable: its backward takes this process's part)
        h = whole_tensor(h)
        if not self.is_last:
            try:
                h, self.boundary_out = boundary.flatten(h, f"the output of stage {self.index}")
            except (TypeError, ValueError) as e:
                raise PipelineError(
                    f"{e} (its last layer is {self._layer(len(self.layers) - 1)})", stage=self.index
                ) from None
            return h
        if self.loss_fn is None or not with_loss:
            return h
        loss = self.loss_fn(h, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise PipelineError(
                f"the loss function returned {shape_of(loss)} on the last stage; it must return a "
                "scalar (use reduction='mean' or 'sum')",
                stage=self.index,
            )
        return loss * scale if scale != 1.0 else loss

    # --- split backward (zero-bubble) --------------------------------------------------------
    def split_backward(self) -> None:
        """Prepare for I/W actions: hook the modules that hold parameters directly, so each
        forward with grad records their outputs (the W pass starts from them).

        A parameter held by exactly one module of the stage, that module having no
        parameter-holding children, gets its gradient in the W pass from that module's output;
        the others (tied within the stage, held by a parent such as nn.MultiheadAttention, or used
        outside their module) from the autograd nodes through which the I pass reaches them."""
        if self._split:
            return
        self._split = True
        if self.is_first:
            return  # its W passes start from the stage's output (``backward_input``)
        holders: dict[int, int] = {}
        for m in self.module.modules():
            for p in m._parameters.values():
                if p is not None:
                    holders[id(p)] = holders.get(id(p), 0) + 1
        for m in self.module.modules():
            params = [p for p in m._parameters.values() if p is not None and holders[id(p)] == 1]
            nested = any(c._parameters for c in m.modules() if c is not m)
            if params and not nested:
                self._w_modules[m] = params
                self._hooks.append(m.register_forward_hook(self._capture_hook))

    def has_weight_pass(self) -> bool:
        """Whether some trainable parameter gets its gradient in W passes (all do)."""
        return any(p.requires_grad for p in self.module.parameters())

    def _capture_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._capturing is not None and torch.is_grad_enabled():
            self._capturing.append((module, output))

    def _run_captured(self, saved: _Saved) -> torch.Tensor:
        captured: list[tuple[nn.Module, torch.Tensor]] = []
        self._capturing = captured
        try:
            out = self._run(saved.input, saved.target, saved.scale)
        finally:
            self._capturing = None
        saved.leaves = captured
        return out

    def backward_input(self, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The I pass of micro-batch ``i``: the gradient of its input (None on the first stage),
        and what ``backward_weight`` starts from: the gradients of the captured module outputs and
        those entering the autograd nodes that lead to the other parameters."""
        self.recompute(i)
        saved = self._saved[i]
        out = saved.output
        assert out is not None and saved.leaves is not None
        x = saved.input
        wants_x = not self.is_first and isinstance(x, torch.Tensor) and x.requires_grad
        saved.leaf_grads = []
        if not (out.requires_grad and (self.is_last or grad is not None)):
            saved.output = None
            return None
        if grad is not None and grad.shape != out.shape:
            raise PipelineError(
                f"stage {self.index} got a gradient of shape {list(grad.shape)} for micro-batch "
                f"{i} whose output has shape {list(out.shape)}",
                stage=self.index,
            )
        if not wants_x:
            # nothing goes upstream (the first stage): I has nothing to compute and W runs the
            # whole backward in one pass, as torch's zero-bubble runtime does; split in two, the
            # backward would take more time (an engine run per module) for nothing to overlap
            params = [p for p in self.module.parameters() if p.requires_grad]
            saved.leaves = None
            saved.output = None
            whole = _WeightPass([out], [grad if grad is not None else torch.ones_like(out)], params, [])
            saved.leaf_grads = [whole] if params else []
            return None
        # a module called more than once in a forward: its parameters' gradients are taken here
        counts: dict[nn.Module, int] = {}
        for m, _ in saved.leaves:
            counts[m] = counts.get(m, 0) + 1
        leaves: list[tuple[torch.Tensor, list[nn.Parameter]]] = []
        covered: set[int] = set()
        for m, o in saved.leaves:
            params = [p for p in self._w_modules[m] if p.requires_grad]
            if counts[m] == 1 and params and isinstance(o, torch.Tensor) and o.requires_grad:
                leaves.append((o, params))
                covered.update(id(p) for p in params)
        foreign = _foreign_uses(out, leaves)
        if foreign:  # used outside their module (a parent reading a child's weight): by graph
            leaves = [(o, kept) for o, ps in leaves if (kept := [p for p in ps if id(p) not in foreign])]
            covered -= foreign
        rest = [p for p in self.module.parameters() if p.requires_grad and id(p) not in covered]
        saved.leaves = None
        saved.output = None
        targets = [x] + [o for o, _ in leaves]
        passes: list[_WeightPass] = []
        groups: list[tuple[list[Any], list[nn.Parameter]]] = []
        if rest:  # those the output does not reach are left without a gradient, as by autograd
            groups, _ = _graph_groups(out, targets, rest)
        # one backward pass to the input and the module outputs (their gradients returned, not
        # accumulated: no copies), the gradients entering the nodes of the groups recorded by hooks
        seen: dict[Any, tuple[Any, ...]] = {}
        hooks = [
            node.register_prehook(lambda g, node=node: seen.__setitem__(node, tuple(g)))
            for nodes, _ in groups for node in nodes
        ]  # fmt: skip
        try:
            got = torch.autograd.grad(
                out, targets, grad, retain_graph=bool(leaves or groups), allow_unused=True
            )
        finally:
            for h in hooks:
                h.remove()
        gx, leaf_grads = got[0], got[1:]
        for nodes, params in groups:
            starts, grads = [], []
            for node in nodes:
                for k, g in enumerate(seen.get(node, ())):
                    if g is not None:
                        starts.append(GradientEdge(node, k))
                        grads.append(g)
            clamps = [(node, seen[node]) for node in nodes if node in seen] if len(nodes) > 1 else []
            if starts:
                passes.append(_WeightPass(starts, grads, params, clamps))
        for (o, params), g in zip(leaves, leaf_grads):
            if g is not None:
                passes.append(_WeightPass([o], [g], params, []))
        saved.leaf_grads = passes
        return gx

    def backward_weight(self, i: int) -> bool:
        """The W pass of micro-batch ``i``: accumulate its weight gradients into ``.grad``;
        whether anything was accumulated."""
        saved = self._saved.pop(i)
        pending = saved.leaf_grads or []
        saved.leaf_grads = None
        for n, w in enumerate(pending):
            pins = [node.register_prehook(lambda g, s=s: s) for node, s in w.clamps]
            try:
                torch.autograd.backward(w.starts, w.grads, inputs=w.params, retain_graph=n < len(pending) - 1)
            finally:
                for h in pins:
                    h.remove()
        return bool(pending)

    def forward(
        self, i: int, x: Any, *, recompute: bool, target: Any = None, scale: float = 1.0
    ) -> torch.Tensor:
        """Forward of micro-batch ``i``; returns the (detached) activation, or on the last stage
        the scaled loss. Kept for ``backward`` (or only its input, when ``recompute``)."""
        if isinstance(x, torch.Tensor) and not self.is_first and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        if recompute:
            rng = RNGSnapshot.capture(self.device)
            with torch.no_grad():
                out = self._run(x, target, scale)
            self._saved[i] = _Saved(x, None, rng, target, scale)
        else:
            saved = _Saved(x, None, None, target, scale)
            with torch.enable_grad():
                out = self._run_captured(saved) if self._split else self._run(x, target, scale)
            saved.output = out
            saved.target, saved.scale = None, 1.0
            self._saved[i] = saved
        return out.detach()

    def infer(self, x: Any) -> torch.Tensor:
        """Forward without autograd (prediction); nothing is kept."""
        with torch.no_grad():
            return self._run(x, None, 1.0, with_loss=False)

    def recompute(self, i: int) -> None:
        """Re-run the forward of micro-batch ``i`` if it was not kept, replaying its RNG state."""
        saved = self._saved[i]
        if saved.output is not None:
            return
        assert saved.rng is not None
        with replay_rng(saved.rng), frozen_buffers(self.module), torch.enable_grad():
            if self._split:
                saved.output = self._run_captured(saved)
            else:
                saved.output = self._run(saved.input, saved.target, saved.scale)

    def backward(self, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of micro-batch ``i`` given the gradient of its output (None on the last
        stage); returns the gradient of its input (None on the first stage)."""
        self.recompute(i)
        saved = self._saved.pop(i)
        out = saved.output
        assert out is not None
        if out.requires_grad and (self.is_last or grad is not None):
            if grad is not None and grad.shape != out.shape:
                raise PipelineError(
                    f"stage {self.index} got a gradient of shape {list(grad.shape)} for micro-batch "
                    f"{i} whose output has shape {list(out.shape)}",
                    stage=self.index,
                )
            torch.autograd.backward(out, grad)
        x = saved.input
        if self.is_first or not isinstance(x, torch.Tensor) or not x.requires_grad:
            return None
        return x.grad

    def clear(self) -> None:
        """Drop micro-batches in flight (after a failure)."""
        self._saved.clear()
