"""Tuples and dicts of tensors across stage boundaries (hidden states with an attention mask):
the boundary codec alone, then 3 stages passing a dict, a tuple and integer / boolean tensors on,
equal to the unsplit model for every schedule and re-materialization mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stratagem
from stratagem.distribute.strategies.pipeline import PipelineStrategy
from stratagem.pipeline import PipelineError, boundary
from stratagem.pipeline.stage import Stage, describe
from stratagem.testing import run_workers

TOL = 1e-5


# --- the codec alone ----------------------------------------------------------------------------------
def test_flatten_unflatten_round_trip_and_gradients() -> None:
    h = torch.randn(4, 3, 5, requires_grad=True)
    aux = torch.randn(4, 2, requires_grad=True)
    ids = torch.randint(-(2**40), 2**40, (4, 7))  # int64 bytes, exactly
    keep = torch.rand(4, 3) > 0.5  # 3 bytes a row: padded to a float32 column
    value = {"h": h * 2, "ids": ids, "more": (keep, None, [aux + 1])}
    carrier, layout = boundary.flatten(value)
    assert layout is not None and carrier.dtype == torch.float32 and carrier.shape == (4, 15 + 14 + 1 + 2)
    assert boundary.decode(boundary.encode(layout)) == layout  # the wire form
    assert layout.describe() == (
        "{'h': [*, 3, 5] (float32), 'ids': [*, 7] (int64), 'more': ([*, 3] (bool), None, [[*, 2] (float32)])}"
    )
    received = carrier.detach().requires_grad_(True)
    got = boundary.unflatten(received, layout)
    assert got["h"].equal(value["h"]) and got["ids"].equal(ids) and got["more"][0].equal(keep)
    assert got["more"][1] is None and got["more"][2][0].equal(aux + 1)
    assert got["ids"].dtype == torch.int64 and not got["ids"].requires_grad
    (got["h"].sum() * 3 + got["more"][2][0].sum()).backward()
    carrier.backward(received.grad)  # the sender's backward from the carrier's gradient
    assert h.grad is not None and aux.grad is not None
    assert h.grad.eq(6).all() and aux.grad.eq(1).all()
    # one tensor is not flattened (the message is as before)
    t = torch.randn(2, 3)
    assert boundary.flatten(t) == (t, None) and boundary.encode(None) == b"" and boundary.decode(b"") is None
    # integers only: a byte carrier (no gradient travels back)
    c, lay = boundary.flatten((torch.arange(6).view(2, 3), torch.ones(2, 1, dtype=torch.bool)))
    assert c.dtype == torch.uint8 and lay is not None
    back = boundary.unflatten(c, lay)
    assert back[0].equal(torch.arange(6).view(2, 3)) and back[1].all()


def test_flatten_refuses_what_cannot_cross() -> None:
    with pytest.raises(ValueError, match=r"the micro-batch as its first dimension"):
        boundary.flatten({"h": torch.zeros(4, 3), "pos": torch.arange(3)})
    with pytest.raises(TypeError, match=r"must share one dtype"):
        boundary.flatten((torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.float64)))
    with pytest.raises(TypeError, match=r"\['x'\] is a str"):
        boundary.flatten({"x": "text"})
    with pytest.raises(TypeError, match="string keys"):
        boundary.flatten({1: torch.zeros(2)})
    with pytest.raises(ValueError, match="does not fit its layout"):
        _, layout = boundary.flatten((torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.long)))
        assert layout is not None
        boundary.unflatten(torch.zeros(4, 5), layout)


def test_a_stage_names_its_last_layer_when_its_output_cannot_cross() -> None:
    layer = nn.Linear(3, 3)

    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"h": layer(x), "pos": torch.arange(3)}

    bad = Bad()
    stage = Stage(0, 2, [layer, bad], 0, ["0", "1", "2"], [describe(layer), "Bad()", "Linear"], torch.device("cpu"))
    with pytest.raises(PipelineError, match=r"the output of stage 0 is \{'h': \[4, 3\] \(float32\), 'pos': \[3\] "
                                            r"\(int64\)\}.*its last layer is layer '1' \(Bad\(\)\)"):
        stage.forward(0, torch.zeros(4, 3), recompute=False)


# --- three stages -----------------------------------------------------------------------------------------
class Embed(nn.Module):
    """x: {"x": float [b, 5], "keep": bool [b, 6], "ids": int64 [b, 6]} -> a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.lin = nn.Linear(5, 6)

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        h = torch.tanh(self.lin(x["x"]) + self.emb(x["ids"]).mean(dim=1))
        return {"h": h, "keep": x["keep"], "ids": x["ids"], "nothing": None}


class Masked(nn.Module):
    """Uses the mask, passes a tuple on (the hidden states, a second differentiable tensor, the mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.gate = nn.Linear(6, 1)

    def forward(self, d: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.lin(d["h"]) * d["keep"] + d["ids"].float() * 0.01
        return torch.relu(h), torch.sigmoid(self.gate(d["h"])), d["keep"]


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, gate, keep = t
        return self.lin(h) * gate, gate, keep


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, gate, keep = t
        return self.lin(h * keep + gate)


def build() -> nn.Sequential:
    return nn.Sequential(Embed(), Masked(), Mix(), Head())


def data(sizes: list[int], seed: int = 1) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [({"x": torch.randn(n, 5, generator=g), "keep": torch.rand(n, 6, generator=g) > 0.3,
              "ids": torch.randint(0, 10, (n, 6), generator=g)}, torch.randint(0, 3, (n,), generator=g))
            for n in sizes]  # fmt: skip


def three_stages() -> list[str]:
    errors: list[str] = []
    loss_fn = nn.CrossEntropyLoss()
    batches = data([7, 7])  # micro-batches of 3 and 2 and 2 (M=3): uneven
    cases = [("gpipe", "never", "loop"), ("gpipe", "always", "fit"), ("1f1b", "except_last", "loop"),
             ("zero_bubble", "never", "loop"), ("zero_bubble", "always", "fit")]  # fmt: skip
    for schedule, remat, how in cases:
        what = f"{schedule}/{remat}/{how}"
        s = PipelineStrategy(3, 3, schedule=schedule, rematerialize=remat, balance=[1, 2, 1], devices="cpu")
        torch.manual_seed(0)
        pipe = s.pipeline(build(), loss_fn, verbose=False)
        with s.scope():
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(0)
        ref = build()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        if how == "fit":
            stratagem.fit(pipe, opt, loss_fn, batches, verbose=0)
        for x, y in batches:
            if how == "loop":
                s.run(pipe.train_step, args=(x, y))
                opt.step()
                opt.zero_grad()
            loss_fn(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        refs = dict(ref.named_parameters())
        for name, p in pipe.named_parameters():
            diff = float((p.detach() - refs[name].detach()).abs().max())
            if not diff < TOL:
                errors.append(f"{what}: {name} differs by {diff}")
        x0 = batches[0][0]
        with torch.no_grad():
            pdiff = float((pipe.predict(x0) - ref(x0)).abs().max())
        if not pdiff < TOL:
            errors.append(f"{what}: predict differs by {pdiff}")
    return errors


@pytest.mark.timeout(150)
def test_three_stages_pass_dicts_tuples_and_masks() -> None:
    assert [r.value for r in run_workers(three_stages, 3, timeout=140)] == [[]] * 3


class _Wire:
    """A channel that keeps what the runtime sends (the runtime's checks, without processes)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def send(self, value: torch.Tensor, dst: int, *, extra: int = 0, tag: int = 0, meta: bytes = b"") -> None:
        self.sent.append(("header", meta))

    def send_raw(self, value: torch.Tensor, dst: int, nbytes: int, tag: int = 0) -> None:
        self.sent.append(("raw", nbytes))

    def post_raw(self, *args: object) -> None:
        return None


def test_a_structure_changed_within_a_mini_batch_is_named() -> None:
    """The layout travels with the first activation of a step; a later micro-batch whose
    structure differs is refused naming both (the runtime's check, no processes needed)."""
    from stratagem.pipeline.runtime import _Links

    layers = [Embed()]
    stage = Stage(0, 2, layers, 0, ["0", "1"], ["Embed()", "Head()"], torch.device("cpu"))
    wire = _Wire()
    links = _Links(stage, wire, [2, 2], 4, [0, 1], [], 2)  # type: ignore[arg-type]
    x = data([4])[0][0]
    first = stage.forward(0, {k: v[:2] for k, v in x.items()}, recompute=False)
    links.send_activation(0, first)
    assert wire.sent[0][0] == "header" and boundary.decode(wire.sent[0][1]) == stage.boundary_out  # type: ignore[arg-type]
    layers[0].register_forward_hook(lambda m, a, out: {k: v for k, v in out.items() if k != "keep"})
    second = stage.forward(1, {k: v[2:] for k, v in x.items()}, recompute=False)
    with pytest.raises(PipelineError) as caught:
        links.send_activation(1, second)
    assert ("stage 0 produced {'h': [*, 6] (float32), 'ids': [*, 6] (int64), 'nothing': None} for micro-batch 1 "
            "but {'h': [*, 6] (float32), 'keep': [*, 6] (bool), 'ids': [*, 6] (int64), 'nothing': None} for the "
            "first one") in str(caught.value)
