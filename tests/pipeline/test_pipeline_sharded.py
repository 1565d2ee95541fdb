"""Pipeline x sharded (issue 32): ``PipelineStrategy(..., data_parallel=2, sharding=ShardingOptions())``
shards each stage's layers over its copies (FSDP); training matches one device on the global batch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.distribute.strategies.pipeline import PipelineStrategy
from stratagem.pipeline import PipelineConfigError
from stratagem.testing import run_workers

RTOL, ATOL = 1e-5, 4e-5


def build() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 8), nn.Tanh(),
        nn.Linear(8, 3),
    )  # fmt: skip


def batches(sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(pipe: Any, ref: nn.Module, what: str, errors: list[str], *, grads: bool) -> None:
    refs = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        a = _whole(p.grad) if grads else _whole(p.detach())
        b = refs[name].grad if grads else refs[name].detach()
        if a is None or b is None or not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
            diff = None if a is None or b is None else float((a - b).abs().max())
            errors.append(f"{what}: {'grad' if grads else 'value'} of {name} differs (max {diff})")


@contextlib.contextmanager
def _counting_reduce_scatters() -> Iterator[list[int]]:
    """Counts FSDP's gradient reduce-scatters (torch.distributed.reduce_scatter_single)."""
    import torch.distributed as dist

    count = [0]
    real = dist.reduce_scatter_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        yield count
    finally:
        dist.reduce_scatter_single = real


def custom_loop_worker() -> dict[str, Any]:
    """Every schedule the sharding takes, both loss reductions, against one device."""
    from torch.distributed.tensor import DTensor

    errors: list[str] = []
    out: dict[str, Any] = {}
    cases = (("gpipe", "mean", "except_last"), ("1f1b", "sum", "always"), ("interleaved_1f1b", "mean", "never"))
    for schedule, reduction, remat in cases:
        what = f"{schedule}/{reduction}/{remat}"
        s = PipelineStrategy(
            2, 2, schedule=schedule, data_parallel=2, rematerialize=remat, devices="cpu", sharding=sg.ShardingOptions()
        )
        loss_fn = nn.CrossEntropyLoss(reduction=reduction)
        with s.scope():
            torch.manual_seed(0)
            pipe = s.pipeline(build(), loss_fn, verbose=False)
            opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
        torch.manual_seed(0)
        ref = build()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
        _compare(pipe, ref, what + " init", errors, grads=False)
        shards = {n: (p.to_local().shape[0], p.shape[0]) for n, p in pipe.named_parameters() if isinstance(p, DTensor)}
        out.setdefault("shards", {})[schedule] = shards
        global_batches = batches([12, 11, 12])  # the second splits 6/5 across the copies
        for step, (x, y) in enumerate(s.experimental_distribute_dataset(global_batches)):
            with _counting_reduce_scatters() as count:
                loss = s.reduce("sum", s.run(pipe.train_step, args=(x, y)))
            # one reduce-scatter per layer per step (at its last micro-batch's backward), not one
            # per micro-batch
            layers = sum(1 for st in pipe.stages for m in st.layers if any(True for _ in m.parameters()))
            if count[0] != layers:
                errors.append(f"{what} step {step}: {count[0]} reduce-scatters for {layers} sharded layers")
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
        state = pipe.state_dict()  # whole tensors, gathered from the copies
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


@pytest.mark.timeout(240)
def test_pipeline_x_sharded_custom_loop_matches_one_device():
    results = run_workers(custom_loop_worker, 4, timeout=200)
    for r in results:
        out = r.value
        assert out["errors"] == [], out["errors"]
        # every stage's weights are split over its 2 copies: each process holds half the rows
        for schedule, shards in out["shards"].items():
            assert shards, f"{schedule}: no parameter of this stage is sharded"
            assert all(local == -(-whole // 2) or local == whole // 2 for local, whole in shards.values()), shards
        assert "sharding=ShardingOptions(" in out["repr"]


def fit_worker() -> dict[str, Any]:
    """fit on a Pipe whose stages are sharded (docs/PIPELINE.md's constructor line, as written),
    against fit under OneDeviceStrategy."""
    import stratagem

    strategy = stratagem.PipelineStrategy(2, 4, schedule="1f1b", data_parallel=2,
                                          sharding=stratagem.ShardingOptions())  # fmt: skip
    s = strategy
    data = batches([16, 16, 12])
    with s.scope():
        torch.manual_seed(0)
        pipe = s.pipeline(build(), nn.CrossEntropyLoss(), verbose=False)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    hist = sg.fit(pipe, opt, nn.CrossEntropyLoss(), data, strategy=s, epochs=2, verbose=0)
    got = pipe.state_dict()
    # as under any strategy: the model and its optimizer built in the scope; fit splits and shards
    with s.scope():
        torch.manual_seed(0)
        model = build()
        model_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model_hist = sg.fit(model, model_opt, nn.CrossEntropyLoss(), data, strategy=s, epochs=2, verbose=0)
    in_scope = {n: p for n, p in model.named_parameters() if p.device.type != "meta"}
    in_scope_whole = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in in_scope.items()}
    one = sg.OneDeviceStrategy()
    with one.scope():
        torch.manual_seed(0)
        ref = build()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_hist = sg.fit(ref, ref_opt, nn.CrossEntropyLoss(), data, strategy=one, epochs=2, verbose=0)
    refs = dict(ref.named_parameters())
    return {
        "params": {k: float((v - refs[k].detach()).abs().max()) for k, v in got.items()},
        "loss": (hist.history["loss"], ref_hist.history["loss"]),
        "in_scope": {k: float((v - refs[k].detach()).abs().max()) for k, v in in_scope_whole.items()},
        "in_scope_loss": model_hist.history["loss"],
    }


@pytest.mark.slow  # fit (its custom loop and checkpoint stay in the main tier), in the slow tier (CI runs it): the main tier under 15 minutes
@pytest.mark.timeout(240)
def test_pipeline_x_sharded_fit_matches_one_device():
    results = run_workers(fit_worker, 4, timeout=200)
    for r in results:
        out = r.value
        assert out["params"] and max(out["params"].values()) < 1e-5, out["params"]
        got, want = out["loss"]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert out["in_scope"] and max(out["in_scope"].values()) < 1e-5, out["in_scope"]
        assert out["in_scope_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(data_parallel=1, sharding=sg.ShardingOptions()), "data_parallel=1 leaves one copy"),
        (dict(data_parallel=2, schedule="zero_bubble", sharding=sg.ShardingOptions()), "zero_bubble"),
        (dict(data_parallel=2, sharding=sg.ShardingOptions(shard_size=3)), r"shard_size=3\) .* must divide"),
        (dict(data_parallel=2, sharding=sg.ShardingOptions(gradient_op="mean")), "leave gradient_op='sum'"),
        (dict(data_parallel=2, sharding=True), "must be a stratagem.ShardingOptions"),
    ],
)
def test_pipeline_sharding_arguments_it_cannot_take_are_clear_errors(kw, match):
    with pytest.raises(PipelineConfigError, match=match):
        PipelineStrategy(2, 2, devices="cpu", **kw)


def hsdp_worker(directory: str) -> dict[str, Any]:
    """HSDP inside each stage: 2 stages x 4 copies, each stage sharded within pairs of copies and
    replicated across the pairs (``shard_size=2``); the custom loop against one device, and a
    checkpoint the test restores into one plain process."""
    from torch.distributed.tensor import DTensor

    s = PipelineStrategy(2, 2, schedule="1f1b", data_parallel=4, devices="cpu",
                         sharding=sg.ShardingOptions(shard_size=2))  # fmt: skip
    loss_fn = nn.CrossEntropyLoss()
    with s.scope():
        torch.manual_seed(0)
        model = build()
        pipe = s.pipeline(model, loss_fn, verbose=False)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    torch.manual_seed(0)
    ref = build()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    data = batches([16, 16, 16], seed=4)
    for x, y in s.experimental_distribute_dataset(data):
        s.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()
    for gx, gy in data:
        loss_fn(ref(gx), gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    errors: list[str] = []
    _compare(pipe, ref, "HSDP in a stage", errors, grads=False)
    placements = sorted({str(p.placements) for p in pipe.parameters() if isinstance(p, DTensor)})
    manager = sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=opt), directory, strategy=s)
    path = manager.save(3)
    return {"errors": errors, "placements": placements, "replicas": s.num_replicas_in_sync, "ckpt": path}


@pytest.mark.slow  # 8 processes: the slow tier (CI runs it)
@pytest.mark.timeout(300)
def test_hsdp_inside_each_stage_matches_one_device_and_restores_in_one_process(tmp_path):
    outs = [r.value for r in run_workers(hsdp_worker, 8, args=(str(tmp_path),), timeout=280)]
    for out in outs:
        assert out["errors"] == [], out["errors"]
        assert out["replicas"] == 4
        assert out["placements"] == ["(Replicate(), Shard(dim=0))"], out["placements"]
    torch.manual_seed(9)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=opt), str(tmp_path)).restore(outs[0]["ckpt"])
    torch.manual_seed(0)
    ref = build()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    data = batches([16, 16, 16, 16], seed=4)
    for gx, gy in data[:3]:
        nn.CrossEntropyLoss()(ref(gx), gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for m, o in ((model, opt), (ref, ref_opt)):  # one more step each: the optimizer state came back too
        nn.CrossEntropyLoss()(m(data[3][0]), data[3][1]).backward()
        o.step()
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p, refs[name], rtol=RTOL, atol=ATOL), name


def checkpoint_worker(directory: str) -> dict[str, Any]:
    """Save mid-training (parameters and Adam's moments, sharded), train on, wreck, restore, train
    the rest again: the same parameters, bit for bit."""
    s = PipelineStrategy(2, 2, schedule="1f1b", data_parallel=2, devices="cpu", sharding=sg.ShardingOptions())
    with s.scope():
        torch.manual_seed(0)
        model = build()
        pipe = s.pipeline(model, nn.CrossEntropyLoss(), verbose=False)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    manager = sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=opt), directory, strategy=s)
    data = batches([8, 8, 8, 8], seed=3)
    dist_data = list(s.experimental_distribute_dataset(data))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        s.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()

    for x, y in dist_data[:2]:
        step(x, y)
    path = manager.save(2)
    for x, y in dist_data[2:]:
        step(x, y)
    straight = pipe.state_dict()
    with torch.no_grad():
        for p in pipe.parameters():
            p.fill_(7.0)
    manager.restore(path)
    for x, y in dist_data[2:]:
        step(x, y)
    resumed = pipe.state_dict()
    return {"path": path, "diff": {k: float((straight[k] - resumed[k]).abs().max()) for k in straight}}


@pytest.mark.timeout(240)
def test_pipeline_x_sharded_checkpoint_resumes_exactly_and_restores_in_one_process(tmp_path):
    results = run_workers(checkpoint_worker, 4, args=(str(tmp_path),), timeout=200)
    for r in results:
        assert r.value["diff"] and max(r.value["diff"].values()) == 0.0, r.value["diff"]
    # the checkpoint holds the whole model (not shards): one plain process restores it (with its
    # optimizer too: tests/checkpoint/test_across_meshes.py)
    torch.manual_seed(1)
    model = build()
    sg.CheckpointManager(sg.Checkpoint(model=model), str(tmp_path)).restore(results[0].value["path"])
    torch.manual_seed(0)
    ref = build()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for x, y in batches([8, 8, 8, 8], seed=3)[:2]:
        nn.CrossEntropyLoss()(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p, q, rtol=RTOL, atol=ATOL), n
