"""Workers for tensor x sharded (FSDP x TP with ShardedStrategy's options): 4 processes, a 2 x 2
("data", "model") mesh, the transformer of sharded_workers split over "model" and sharded unit by
unit over "data"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from sharded_workers import (  # the tests' folder is on sys.path
    Block,
    _layouts,
    accumulation,
    full_state,
    make_adam,
    make_transformer,
    max_diff,
    seq_batches,
    seq_mse,
)

import stratagem
from stratagem.testing.contracts import train_reference, train_under


def _strategy(**options: Any) -> Any:
    from stratagem.distribute import DeviceMesh, ModelParallelStrategy

    mesh = DeviceMesh((2, 2), ("data", "model"))
    return ModelParallelStrategy(mesh, _layouts(mesh), devices="cpu", sharding=stratagem.ShardingOptions(**options))


def _units(model: torch.nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def custom_loop(steps: int) -> dict[str, Any]:
    """Per-unit FSDP (each Block a unit) kept gathered between forward and backward, summed
    gradients (tf.distribute's contract): the custom loop against one device."""
    s = _strategy(units=Block, reshard_after_forward=False)
    batches = seq_batches(steps)
    model, losses = train_under(s, make_transformer, make_adam, seq_mse, batches)
    out: dict[str, Any] = {"units": _units(model), "plan": str(s.extended.plans_fsdp[-1])}
    out["reshard_after_forward"] = [m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                                    for m in (model[0], model[1])]
    out["q_placements"] = str(model[0].q.weight.placements)
    out["local_q_shape"] = tuple(model[0].q.weight.to_local().shape)
    out["losses"] = losses
    out["diff"] = max_diff(full_state(model), train_reference(make_transformer, make_adam, seq_mse, batches, seed=0))
    return out


def mean_reduction(steps: int) -> dict[str, Any]:
    """gradient_op="mean": FSDP's own default, a per-replica mean loss (DDP style) averaged
    across the data axis, equals one device on the global batch (SGD: Adam would hide a factor
    of 2 in the gradients)."""
    s = _strategy(gradient_op="mean")
    torch.manual_seed(0)
    with s.scope():
        model = make_transformer()
        opt = _sgd(model.parameters())
    batches = seq_batches(steps)
    for x, y in s.experimental_distribute_dataset(batches):

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            seq_mse(model(x), y).mean().backward()
            opt.step()

        s.run(step, args=(x, y))
    want = train_reference(make_transformer, _sgd, seq_mse, batches, seed=0)
    return {"units": _units(model), "diff": max_diff(full_state(model), want)}


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def fit_and_resume(tmp: str, steps: int) -> dict[str, Any]:
    """fit with per-block units, a checkpoint at half
    way, the weights wrecked, restored, and fit on: bit for bit the run straight through. The
    strategy is made by docs/STRATEGIES.md's lines, as written."""
    mesh = stratagem.DeviceMesh((2, 2), ("data", "model"))
    layout_map = _layouts(mesh)
    strategy = stratagem.ModelParallelStrategy(mesh, layout_map,
                                               sharding=stratagem.ShardingOptions(units=Block))  # fmt: skip
    s = strategy
    torch.manual_seed(0)
    with s.scope():
        model = make_transformer()
        opt = make_adam(model.parameters())
    batches = seq_batches(steps)
    half = steps // 2
    out: dict[str, Any] = {"units": _units(model)}
    stratagem.fit(model, opt, seq_mse, batches[:half], verbose=0)
    manager = stratagem.CheckpointManager(stratagem.Checkpoint(model=model, optimizer=opt), Path(tmp, "txs"))
    out["ckpt"] = manager.save(half)
    stratagem.fit(model, opt, seq_mse, batches[half:], verbose=0)
    straight = full_state(model)
    want = train_reference(make_transformer, make_adam, seq_mse, batches, seed=0)
    out["diff"] = max_diff(straight, want)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.0).add_(3.0)  # wrecked: the restore must bring back every value
    manager.restore(out["ckpt"])
    stratagem.fit(model, opt, seq_mse, batches[half:], verbose=0)
    out["resumed_vs_straight"] = max(max_diff(full_state(model), straight).values())
    out.update(accumulation(s, make_transformer, seq_batches(6), seq_mse))
    return out


def mixed_precision(steps: int) -> dict[str, Any]:
    """mixed_precision=MixedPrecisionPolicy(bf16 parameters, fp32 reductions): each unit computes
    in bf16 on its tensor-parallel shards; each step's loss is near one device's fp32 run."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    s = _strategy(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    seen: list[str] = []
    batches = seq_batches(steps)
    torch.manual_seed(0)
    with s.scope():
        model = make_transformer()
        opt = make_adam(model.parameters())
    model[0].q.register_forward_pre_hook(lambda m, a: seen.append(str(m.weight.dtype)))
    losses = []
    for x, y in s.experimental_distribute_dataset(batches):

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = stratagem.compute_average_loss(seq_mse(model(x).float(), y))
            loss.backward()
            opt.step()
            return loss.detach()

        losses.append(float(s.reduce("sum", s.run(step, args=(x, y)))))
    torch.manual_seed(0)
    ref = make_transformer()
    ref_opt = make_adam(ref.parameters())
    want = []
    for x, y in batches:
        ref_opt.zero_grad()
        loss = seq_mse(ref(x), y).mean()
        loss.backward()
        ref_opt.step()
        want.append(float(loss.detach()))
    return {"dtypes": sorted(set(seen)), "stored": str(model[0].q.weight.dtype),
            "relative": max(abs(a - b) / abs(b) for a, b in zip(losses, want))}


def hsdp_x_tensor(tmp: str, steps: int) -> dict[str, Any]:
    """HSDP x TP on 8 processes: a ("data", "model") mesh of 4 x 2 with
    ``ShardingOptions(units=Block, shard_size=2)``: each Block split over "model", sharded over
    pairs of data replicas and replicated across the pairs (torch's 3-D mesh data_replicate x
    data_shard x model). The custom loop and fit against one device, the groups' sizes, and a
    checkpoint that restores into one plain process (the test trains it on there)."""
    mesh = stratagem.DeviceMesh((4, 2), ("data", "model"))
    strategy = stratagem.ModelParallelStrategy(mesh, _layouts(mesh),
                                               sharding=stratagem.ShardingOptions(units=Block, shard_size=2))  # fmt: skip
    s = strategy
    batches = seq_batches(steps, size=8)
    model, losses = train_under(s, make_transformer, make_adam, seq_mse, batches)
    want = train_reference(make_transformer, make_adam, seq_mse, batches, seed=0)
    out: dict[str, Any] = {"units": _units(model), "losses": losses, "diff": max_diff(full_state(model), want)}
    out["replicas"] = s.num_replicas_in_sync
    out["mesh"] = str(model[0].q.weight.device_mesh.mesh_dim_names)
    out["q_placements"] = str(model[0].q.weight.placements)
    out["local_q_shape"] = tuple(model[0].q.weight.to_local().shape)
    torch.manual_seed(0)
    with s.scope():
        fitted = make_transformer()
        opt = make_adam(fitted.parameters())
    half = steps // 2
    stratagem.fit(fitted, opt, seq_mse, batches[:half], verbose=0)
    manager = stratagem.CheckpointManager(stratagem.Checkpoint(model=fitted, optimizer=opt), Path(tmp, "hsdp_tp"))
    out["ckpt"] = manager.save(half)
    stratagem.fit(fitted, opt, seq_mse, batches[half:], verbose=0)
    out["fit_diff"] = max_diff(full_state(fitted), want)
    return out
