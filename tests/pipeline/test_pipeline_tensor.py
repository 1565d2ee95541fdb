"""Pipeline x tensor (issue 32): ``PipelineStrategy(..., layout_map=layout_map)`` splits each
stage's layers over the layout map's ``"model"`` axis (Megatron's column / row pairs, torch's
``parallelize_module``), times ``data_parallel`` copies; training matches one device on the
global batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.distribute.strategies.pipeline import PipelineStrategy
from stratagem.pipeline import PipelineConfigError
from stratagem.testing import run_workers

RTOL, ATOL = 1e-5, 4e-5


class Block(nn.Module):
    """A transformer's MLP with its residual: fc1 split by output features, fc2 by input."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def build() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 16), Block(16), Block(16), nn.Linear(16, 3))


def layout(mesh: sg.DeviceMesh) -> sg.LayoutMap:
    layout_map = sg.LayoutMap(mesh)
    layout_map[r"fc1\.weight"] = ("model", None)
    layout_map[r"fc2\.weight"] = (None, "model")
    return layout_map


def batches(sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    from stratagem.core.whole import whole_tensor

    return whole_tensor(t)  # type: ignore[no-any-return]


def _compare(pipe: Any, ref: nn.Module, what: str, errors: list[str], *, grads: bool) -> None:
    refs = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        a = _whole(p.grad) if grads else _whole(p.detach())
        b = refs[name].grad if grads else refs[name].detach()
        if a is None or b is None or not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
            diff = None if a is None or b is None else float((a - b).abs().max())
            errors.append(f"{what}: {'grad' if grads else 'value'} of {name} differs (max {diff})")


def custom_loop_worker(data_parallel: int, cases: tuple[tuple[str, str, str], ...], sharded: bool = False) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    errors: list[str] = []
    out: dict[str, Any] = {"split": {}}
    for schedule, reduction, remat in cases:
        what = f"{schedule}/{reduction}/{remat}"
        mesh = sg.DeviceMesh((2,), ("model",))
        s = PipelineStrategy(
            2, 2, schedule=schedule, data_parallel=data_parallel, rematerialize=remat, devices="cpu",
            layout_map=layout(mesh), sharding=sg.ShardingOptions() if sharded else None,
        )  # fmt: skip
        loss_fn = nn.CrossEntropyLoss(reduction=reduction)
        with s.scope():
            torch.manual_seed(0)
            pipe = s.pipeline(build(), loss_fn, verbose=False)
            opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
        torch.manual_seed(0)
        ref = build()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
        _compare(pipe, ref, what + " init", errors, grads=False)
        out["split"][schedule] = {
            n: (tuple(p.to_local().shape), tuple(p.shape)) for n, p in pipe.named_parameters() if isinstance(p, DTensor)
        }
        global_batches = batches([12, 11, 12])
        for step, (x, y) in enumerate(s.experimental_distribute_dataset(global_batches)):
            loss = s.reduce("sum", s.run(pipe.train_step, args=(x, y)))
            gx, gy = global_batches[step]
            ref_loss = loss_fn(ref(gx), gy)
            ref_loss.backward()
            if not torch.allclose(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL):
                errors.append(f"{what} step {step}: loss {float(loss)} != {float(ref_loss)}")
            _compare(pipe, ref, f"{what} step {step}", errors, grads=True)
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        _compare(pipe, ref, what + " after 3 steps", errors, grads=False)
        state = pipe.state_dict()  # whole tensors, gathered from the tensor-parallel parts
        refs = dict(ref.named_parameters())
        if sorted(state) != sorted(n for n, _ in pipe.named_parameters()) or any(
            not torch.allclose(v, refs[k].detach(), rtol=RTOL, atol=ATOL) for k, v in state.items()
        ):
            errors.append(f"{what}: state_dict() is not the whole trained parameters")
        pred = pipe.predict(global_batches[0][0])
        if not torch.allclose(pred, ref(global_batches[0][0]).detach(), rtol=RTOL, atol=ATOL):
            errors.append(f"{what}: predict differs from one device")
    out["errors"] = errors
    out["repr"] = repr(s)
    return out


def _check_split(out: dict[str, Any], sharded: bool = False) -> None:
    assert out["errors"] == [], out["errors"]
    for schedule, split in out["split"].items():
        # every stage holds a Block: fc1 split by rows (output features), fc2 by columns; sharded,
        # each part's rows halved again over the 2 copies
        weights = {n.split(".", 1)[1]: v for n, v in split.items() if n.endswith("weight") and ".fc" in n}
        want = {"fc1.weight": ((8, 16), (32, 16)), "fc2.weight": ((8, 16), (16, 32))} if sharded else \
            {"fc1.weight": ((16, 16), (32, 16)), "fc2.weight": ((16, 16), (16, 32))}
        assert weights == want, (schedule, split)


@pytest.mark.timeout(300)
def test_pipeline_x_tensor_custom_loop_matches_one_device():
    """2 stages x 2 tensor-parallel processes, every schedule, both reductions, every
    re-materialization mode."""
    cases = (
        ("gpipe", "mean", "except_last"),
        ("1f1b", "sum", "always"),
        ("interleaved_1f1b", "mean", "never"),
        ("zero_bubble", "mean", "never"),
    )
    results = run_workers(custom_loop_worker, 4, args=(1, cases), timeout=260)
    for r in results:
        _check_split(r.value)
        assert "tensor_parallel=2" in r.value["repr"]


@pytest.mark.slow  # 8 processes: the slow tier (CI runs it), the main one under 15 minutes
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("schedule", "sharded"), [("1f1b", False), ("gpipe", True)])
def test_pipeline_x_tensor_x_data_on_8_processes_matches_one_device(schedule, sharded):
    """2 copies x 2 stages x 2 tensor-parallel processes: the split parts' gradients summed across
    the copies; ``sharded``: each stage's split layers sharded over its copies too (FSDP x TP
    inside a stage, on the job's one torch mesh)."""
    results = run_workers(custom_loop_worker, 8, args=(2, ((schedule, "mean", "except_last"),), sharded), timeout=260)
    for r in results:
        _check_split(r.value, sharded=sharded)
        assert "data_parallel=2, tensor_parallel=2" in r.value["repr"]
        assert ("sharding=ShardingOptions(" in r.value["repr"]) == sharded


def fit_and_checkpoint_worker(directory: str) -> dict[str, Any]:
    """docs/PIPELINE.md's constructor lines as written; fit, then a checkpoint mid-training (parameters and Adam's moments of split layers),
    trained on, wrecked, restored, trained again: the same parameters, bit for bit."""
    import stratagem

    # docs/PIPELINE.md's lines, as written
    mesh = stratagem.DeviceMesh((2,), ("model",))
    layout_map = stratagem.LayoutMap(mesh)
    layout_map[r"fc1\.weight"] = ("model", None)  # column-parallel: output features split
    layout_map[r"fc2\.weight"] = (None, "model")  # row-parallel: input features split
    strategy = stratagem.PipelineStrategy(2, 4, schedule="1f1b", layout_map=layout_map)
    s = strategy
    data = batches([16, 16, 12])
    with s.scope():
        torch.manual_seed(0)
        model = build()
        pipe = s.pipeline(model, nn.CrossEntropyLoss(), verbose=False)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    hist = sg.fit(pipe, opt, nn.CrossEntropyLoss(), data, strategy=s, epochs=2, verbose=0)
    fitted = {k: v.clone() for k, v in pipe.state_dict().items()}  # (a whole parameter is returned as itself)
    manager = sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=opt), directory, strategy=s)
    more = list(s.experimental_distribute_dataset(batches([8, 8, 8, 8], seed=3)))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        s.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()

    for x, y in more[:2]:
        step(x, y)
    path = manager.save(2)
    for x, y in more[2:]:
        step(x, y)
    straight = pipe.state_dict()
    with torch.no_grad():
        for p in pipe.parameters():
            p.fill_(7.0)
    manager.restore(path)
    for x, y in more[2:]:
        step(x, y)
    resumed = pipe.state_dict()
    return {
        "fitted": fitted,
        "loss": hist.history["loss"],
        "path": path,
        "diff": {k: float((straight[k] - resumed[k]).abs().max()) for k in straight},
    }


@pytest.mark.timeout(300)
def test_pipeline_x_tensor_fit_and_checkpoint_match_one_device(tmp_path):
    results = run_workers(fit_and_checkpoint_worker, 4, args=(str(tmp_path),), timeout=260)
    one = sg.OneDeviceStrategy()
    with one.scope():
        torch.manual_seed(0)
        ref = build()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ref_hist = sg.fit(ref, ref_opt, nn.CrossEntropyLoss(), batches([16, 16, 12]), strategy=one, epochs=2, verbose=0)
    refs = {k: v.detach().clone() for k, v in ref.named_parameters()}
    for r in results:
        out = r.value
        assert out["loss"] == pytest.approx(ref_hist.history["loss"], rel=1e-5, abs=1e-6)
        assert out["fitted"] and all(torch.allclose(v, refs[k], rtol=RTOL, atol=ATOL) for k, v in out["fitted"].items()), {k: float((v - refs[k]).abs().max()) for k, v in out["fitted"].items()}
        assert out["diff"] and max(out["diff"].values()) == 0.0, out["diff"]
    # the checkpoint holds the whole model: one plain process restores it and goes on as one device
    for x, y in batches([8, 8, 8, 8], seed=3)[:2]:
        nn.CrossEntropyLoss()(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.manual_seed(1)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=opt), str(tmp_path)).restore(results[0].value["path"])
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p, q, rtol=RTOL, atol=ATOL), n
    for x, y in batches([8, 8, 8, 8], seed=3)[2:]:
        for m, o in ((model, opt), (ref, ref_opt)):
            nn.CrossEntropyLoss()(m(x), y).backward()
            o.step()
            o.zero_grad()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p, q, rtol=RTOL, atol=ATOL), n


def _map(shape: tuple[int, ...], names: tuple[str, ...]) -> sg.LayoutMap:
    return sg.LayoutMap(sg.DeviceMesh(shape, names))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(layout_map={"fc1": ("model", None)}), "layout_map must be a stratagem.LayoutMap"),
        (dict(layout_map=_map((2,), ("tensor",))), "has no axis 'model'"),
        (dict(layout_map=_map((2, 2), ("data", "model"))), "an axis 'data' of 2"),
        (dict(layout_map=_map((2,), ("model",)), sharding=sg.ShardingOptions()), "data_parallel=1 leaves one copy"),
    ],
)
def test_pipeline_layout_maps_it_cannot_take_are_clear_errors(kw, match):
    with pytest.raises(PipelineConfigError, match=match):
        PipelineStrategy(2, 2, devices="cpu", **kw)


def wrong_size_worker() -> str:
    try:
        PipelineStrategy(2, 2, devices="cpu", layout_map=_map((2,), ("model",)))
    except PipelineConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_a_job_of_the_wrong_size_names_the_three_degrees():
    for r in run_workers(wrong_size_worker, 2, timeout=100):
        assert "this job has 2 processes but PipelineStrategy(num_stages=2, data_parallel=1, a layout map over 2 " \
            "processes) needs 2 x 1 x 2 = 4" in r.value, r.value
