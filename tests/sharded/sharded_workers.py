"""Worker functions for the ShardedStrategy tests (run by stratagem.testing.run_workers)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import stratagem
from stratagem.testing.contracts import train_reference, train_under

LR = 1e-2


def make_mlp() -> nn.Module:
    # uneven first dimensions (33, 9, 3 rows) so some shards are shorter or empty on 2 and 4 ranks
    return nn.Sequential(nn.Linear(12, 33), nn.Tanh(), nn.Linear(33, 64), nn.ReLU(), nn.Linear(64, 9), nn.Tanh(), nn.Linear(9, 3))


def make_adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean(dim=1)


def global_batches(n: int, size: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 12, generator=g), torch.randn(size, 3, generator=g)) for _ in range(n)]


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return {k: float((a[k] - b[k]).abs().max()) if a[k].numel() else 0.0 for k in a}


def local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of this process's storage behind parameters, gradients and optimizer state."""
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        key = st.data_ptr() or id(st)
        if key in seen:
            return
        seen.add(key)
        total += st.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for state in opt.state.values():
        for v in state.values():
            add(v)
    return total


def reference_bytes(seed: int = 0) -> int:
    """The same, for plain single-device training (one step, so every state exists)."""
    torch.manual_seed(seed)
    m = make_mlp()
    o = make_adam(m.parameters())
    x, y = global_batches(1)[0]
    mse(m(x), y).mean().backward()
    o.step()
    return local_bytes(m, o)


# --- 2 processes: parity, memory, the Strategy surface, fit, checkpoints, options ---------------
def _reduce_scatters(fn: Any) -> int:
    """How many reduce-scatters this process ran in ``fn()`` (torch's profiler names each)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if "reduce_scatter" in e.name)


def accumulation(s: Any, make: Any = None, data: Any = None, loss: Any = None) -> dict[str, Any]:
    """fit with gradient_accumulation_steps=3 on 6 batches: one device's parameters on the batches
    joined three by three, and one reduce-scatter per unit per update (the micro-steps before it
    accumulate locally)."""
    make_mlp = make or globals()["make_mlp"]
    mse = loss or globals()["mse"]
    data = data or global_batches(6, size=4, seed=7)

    def fitted(batches: list[Any], k: int) -> tuple[nn.Module, int]:
        torch.manual_seed(0)
        with s.scope():
            model = make_mlp()
            opt = make_adam(model.parameters())
        count = _reduce_scatters(lambda: stratagem.fit(model, opt, mse, batches, epochs=1, verbose=0,
                                                       gradient_accumulation_steps=k))
        return model, count

    model, accumulated = fitted(data, 3)  # 6 batches: 2 updates
    _, one_update = fitted(data[:1], 1)
    joined = [(torch.cat([x for x, _ in data[i : i + 3]]), torch.cat([y for _, y in data[i : i + 3]])) for i in (0, 3)]
    want = train_reference(make_mlp, make_adam, mse, joined, seed=0)
    return {"accum_diff": max(max_diff(full_state(model), want).values()),
            "accum_reduce_scatters": accumulated, "update_reduce_scatters": one_update}


def two_processes(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    s = stratagem.ShardedStrategy(devices="cpu")
    n = s.num_replicas_in_sync

    # initial values equal single-device initialisation from the same seed
    torch.manual_seed(0)
    with s.scope():
        model = make_mlp()
    torch.manual_seed(0)
    out["init_diff"] = max(max_diff(full_state(model), make_mlp().state_dict()).values())
    out["plan"] = str(s.extended.plans[-1])
    out["param_type"] = type(next(model.parameters())).__name__

    # parity: several Adam steps, per parameter, and the memory each rank holds
    batches = global_batches(4)
    model, opt = train_sharded(s, batches)
    want = train_reference(make_mlp, make_adam, mse, batches, seed=0)
    out["adam_diff"] = max_diff(full_state(model), want)
    out["bytes"] = local_bytes(model, opt)
    out["reference_bytes"] = reference_bytes()
    out["n"] = n

    # gather / reduce / distribute_datasets_from_function
    def per_replica(ctx: Any) -> list[torch.Tensor]:
        return [torch.arange(4.0) + 10 * ctx.input_pipeline_id]

    got = [t for t in s.distribute_datasets_from_function(per_replica)]
    out["dfn_sum"] = float(s.reduce("sum", got[0], axis=0))
    out["gather"] = s.gather(torch.full((s.extended.replica_id + 1,), float(s.extended.replica_id)), axis=0).tolist()

    # fit / evaluate / predict: the same parameters and metrics as one device
    data = global_batches(3, size=6, seed=5)
    torch.manual_seed(0)
    with s.scope():
        fm = make_mlp()
        fo = make_adam(fm.parameters())
    hist = stratagem.fit(fm, fo, mse, data, epochs=2, metrics=["mae"], verbose=0)
    ev = stratagem.evaluate(fm, mse, data, metrics=["mae"], return_dict=True)
    pred = stratagem.predict(fm, [x for x, _ in data])
    torch.manual_seed(0)
    rm = make_mlp()
    ro = make_adam(rm.parameters())
    for _ in range(2):
        for x, y in data:
            ro.zero_grad()
            mse(rm(x), y).mean().backward()
            ro.step()
    with torch.no_grad():
        xs = torch.cat([x for x, _ in data])
        ys = torch.cat([y for _, y in data])
        rout = rm(xs)
        out["fit_eval"] = (ev["loss"], float(mse(rout, ys).mean()), ev["mae"], float((rout - ys).abs().mean()))
        out["fit_pred_diff"] = float((pred - rout).abs().max())
    out["fit_diff"] = max(max_diff(full_state(fm), rm.state_dict()).values())
    out["fit_epochs"] = len(hist.history["loss"])
    out.update(accumulation(s))

    # checkpoint: every rank writes its own part; restore into a fresh sharded model; continue
    ckdir = Path(tmp, "ck2")
    step = torch.tensor(3)
    manager = stratagem.CheckpointManager(stratagem.Checkpoint(model=fm, optimizer=fo, step=step, rng=stratagem.RNGState()), ckdir)
    path = manager.save(3)
    out["ckpt_files"] = sorted(os.listdir(Path(path, "sharded")))
    torch.manual_seed(123)
    with s.scope():
        fm2 = make_mlp()
        fo2 = make_adam(fm2.parameters())
    step2 = torch.tensor(0)
    m2 = stratagem.CheckpointManager(stratagem.Checkpoint(model=fm2, optimizer=fo2, step=step2, rng=stratagem.RNGState()), ckdir)
    # the sharded checkpoint restores into another strategy: a mirrored model and optimizer
    mirrored = stratagem.MirroredStrategy("cpu")
    torch.manual_seed(99)
    with mirrored.scope():
        mm = make_mlp()
        mo = make_adam(mm.parameters())
    stratagem.CheckpointManager(stratagem.Checkpoint(model=mm, optimizer=mo), ckdir).restore(path)
    out["mirrored_restored_diff"] = max(max_diff(mm.state_dict(), full_state(fm)).values())
    out["mirrored_adam_steps"] = sorted({int(st["step"]) for st in mo.state.values()})

    # and a mirrored (whole-tensor) checkpoint restores into a sharded model and optimizer
    mpath = stratagem.CheckpointManager(stratagem.Checkpoint(model=mm, optimizer=mo, step=step), Path(tmp, "mirrored")).save(6)
    with s.scope():
        sm = make_mlp()
        so = make_adam(sm.parameters())
    step3 = torch.tensor(0)
    stratagem.CheckpointManager(stratagem.Checkpoint(model=sm, optimizer=so, step=step3), Path(tmp, "mirrored")).restore(mpath)
    out["from_mirrored_diff"] = max(max_diff(full_state(sm), mm.state_dict()).values())
    later = global_batches(2, size=6, seed=13)
    stratagem.fit(sm, so, mse, later, verbose=0)
    stratagem.fit(mm, mo, mse, later, verbose=0)
    out["from_mirrored_continued"] = max(max_diff(full_state(sm), mm.state_dict()).values())
    out["from_mirrored_step"] = int(step3)

    # an optimizer saved before its first step stays without state (its next update unchanged)
    with s.scope():
        fresh_model = make_mlp()
        fresh_opt = make_adam(fresh_model.parameters())
    stratagem.CheckpointManager(stratagem.Checkpoint(model=fresh_model, optimizer=fresh_opt), Path(tmp, "fresh")).save(0)
    out["fresh_state_after_save"] = len(fresh_opt.state)
    out["restored_from"] = Path(m2.restore_or_initialize() or "").name
    out["restored_step"] = int(step2)
    out["restored_diff"] = max(max_diff(full_state(fm2), full_state(fm)).values())
    more = global_batches(2, size=6, seed=9)
    stratagem.fit(fm, fo, mse, more, verbose=0)
    stratagem.fit(fm2, fo2, mse, more, verbose=0)
    out["continued_diff"] = max(max_diff(full_state(fm2), full_state(fm)).values())

    # fit with BackupAndRestore: interrupted after two epochs, resumed in a fresh model
    from stratagem.callbacks import BackupAndRestore

    class Interrupt(stratagem.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if epoch == 2:
                raise KeyboardInterrupt

    backup = Path(tmp, "backup")
    torch.manual_seed(0)
    with s.scope():
        bm = make_mlp()
        bo = make_adam(bm.parameters())
    try:
        stratagem.fit(bm, bo, mse, data, epochs=3, callbacks=[BackupAndRestore(backup), Interrupt()], verbose=0)
    except KeyboardInterrupt:
        pass
    torch.manual_seed(42)
    with s.scope():
        bm = make_mlp()
        bo = make_adam(bm.parameters())
    resumed = stratagem.fit(bm, bo, mse, data, epochs=3, callbacks=[BackupAndRestore(backup)], verbose=0)
    for _ in range(1):  # one more epoch of the single-device reference
        for x, y in data:
            ro.zero_grad()
            mse(rm(x), y).mean().backward()
            ro.step()
    out["resumed_diff"] = max(max_diff(full_state(bm), rm.state_dict()).values())
    out["resumed_epochs"] = len(resumed.history["loss"])

    # errors that say what to do
    class Scale(nn.Module):  # parameters initialised in __init__, no reset_parameters
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

    errors = {}
    meta = stratagem.ShardedStrategy(init="meta", devices="cpu")
    try:
        with meta.scope():
            kept = nn.Sequential(nn.Linear(2, 3), Scale())  # noqa: F841 - alive when the scope closes
    except TypeError as e:
        errors["no_reset"] = str(e)
    try:
        with meta.scope():
            rewritten = nn.Linear(2, 3)
            nn.init.zeros_(rewritten.weight)  # after its reset_parameters(): a replay would lose it
    except TypeError as e:
        errors["rewritten"] = str(e)
    # the default (init="auto") builds both on the host as one device does, then shards them
    torch.manual_seed(5)
    with s.scope():
        kept = nn.Sequential(nn.Linear(2, 3), Scale())
        rewritten = nn.Linear(2, 3)
        nn.init.zeros_(rewritten.bias)
    torch.manual_seed(5)
    want_kept, want_rewritten = nn.Sequential(nn.Linear(2, 3), Scale()), nn.Linear(2, 3)
    nn.init.zeros_(want_rewritten.bias)
    out["auto_init_diff"] = max(
        max(max_diff(full_state(kept), want_kept.state_dict()).values()),
        max(max_diff(full_state(rewritten), want_rewritten.state_dict()).values()),
    )
    plain = make_mlp()
    try:
        s.run(lambda m: m(torch.zeros(1, 12)), args=(plain,))
    except stratagem.OutsideScopeError as e:
        errors["outside_run"] = str(e)
    try:
        stratagem.fit(plain, make_adam(plain.parameters()), mse, data, strategy=s, verbose=0)
    except stratagem.OutsideScopeError as e:
        errors["outside_fit"] = str(e)
    out["errors"] = errors

    # options: no resharding after forward, units by class, mixed precision, CPU offload
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    variants = {
        "default_units": stratagem.ShardedStrategy(units=100, devices="cpu"),  # the root keeps a Linear
        "keep_gathered": stratagem.ShardedStrategy(reshard_after_forward=False, units=nn.Linear, devices="cpu"),
        "offload": stratagem.ShardedStrategy(offload=True, units=100, devices="cpu"),
    }
    for name, vs in variants.items():
        vm, _ = train_under(vs, make_mlp, make_adam, mse, batches, seed=0)
        out[f"{name}_diff"] = max(max_diff(full_state(vm), want).values())
        out[f"{name}_plan"] = str(vs.extended.plans[-1])
        # which units free their gathered parameters after forward (FSDP2's state after a step)
        groups = {n or "<root>": m._get_fsdp_state()._fsdp_param_group for n, m in vm.named_modules() if isinstance(m, FSDPModule)}
        out[f"{name}_reshards"] = {n: g.post_forward_mesh_info is not None for n, g in groups.items() if g is not None}
    mp = stratagem.ShardedStrategy(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), devices="cpu")
    vm, _ = train_under(mp, make_mlp, make_adam, mse, batches, seed=0)
    out["bf16_diff"] = max(max_diff(full_state(vm), want).values())
    out["bf16_dtype"] = str(next(vm.parameters()).dtype)
    return out


def train_sharded(s: Any, batches: list[Any], seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """contracts.train_under's loop (scope, distributed data, run), keeping the optimizer."""
    torch.manual_seed(seed)
    with s.scope():
        model = make_mlp()
        opt = make_adam(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = stratagem.compute_average_loss(mse(model(x), y))
        loss.backward()
        opt.step()
        return loss.detach()

    for x, y in s.experimental_distribute_dataset(batches):
        s.reduce("sum", s.run(step, args=(x, y)))
    return model, opt


# --- 4 processes: parity, a model larger than the budget, a checkpoint for fewer processes -----
def _rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM) to the current one


def _rss_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


BIG_LAYERS, BIG_WIDTH = 32, 768


def make_big() -> nn.Module:
    return nn.Sequential(*[nn.Linear(BIG_WIDTH, BIG_WIDTH, bias=False) for _ in range(BIG_LAYERS)])


def four_processes(tmp: str, steps_before: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    s = stratagem.ShardedStrategy(devices="cpu")
    batches = global_batches(steps_before)
    model, opt = train_sharded(s, batches)
    want = train_reference(make_mlp, make_adam, mse, batches, seed=0)
    out["adam_diff"] = max_diff(full_state(model), want)
    out["bytes"] = local_bytes(model, opt)
    manager = stratagem.CheckpointManager(stratagem.Checkpoint(model=model, optimizer=opt), Path(tmp, "ck4"))
    out["ckpt"] = manager.save(steps_before)

    # a model larger than this process's budget: built, trained a step, checkpointed
    full = BIG_LAYERS * BIG_WIDTH * BIG_WIDTH * 4
    out["big_full_bytes"] = full
    _rss_reset()
    base = _rss_now()
    torch.manual_seed(0)
    meta = stratagem.ShardedStrategy(devices="cpu", init="meta")  # never the whole model here
    with meta.scope():
        big = make_big()
        bo = torch.optim.SGD(big.parameters(), lr=0.1)
    out["big_build_peak"] = _rss_peak() - base
    x = torch.randn(2, BIG_WIDTH)

    def step(x: torch.Tensor) -> None:
        bo.zero_grad()
        stratagem.compute_average_loss(big(x).square().mean(dim=1)).backward()
        bo.step()

    meta.run(step, args=(x,))
    out["big_step_peak"] = _rss_peak() - base
    bm = stratagem.CheckpointManager(stratagem.Checkpoint(model=big), Path(tmp, "big"))
    _rss_reset()
    base = _rss_now()
    bm.save(1)
    out["big_save_peak"] = _rss_peak() - base
    out["big_grad_bytes"] = sum(p.grad.to_local().untyped_storage().nbytes() for p in big.parameters() if p.grad is not None)
    out["big_local_param_bytes"] = sum(p.to_local().untyped_storage().nbytes() for p in big.parameters())
    big = bo = bm = None  # released before the host build is measured

    # the same model built on the host (init="auto"): one full copy at the peak, then 1/N
    _rss_reset()
    base = _rss_now()
    torch.manual_seed(0)
    with s.scope():
        host = make_big()
        ho = torch.optim.SGD(host.parameters(), lr=0.1)  # holds the full parameters until sharded
    out["host_build_peak"] = _rss_peak() - base
    out["host_after_build"] = _rss_now() - base
    out["host_local_param_bytes"] = sum(p.to_local().untyped_storage().nbytes() for p in host.parameters())
    torch.manual_seed(0)
    want_big = make_big().state_dict()
    out["host_init_diff"] = max(max_diff(full_state(host), want_big).values())
    del host, ho, want_big

    # HSDP: sharded over pairs of processes, replicated across the two pairs
    hs = stratagem.ShardedStrategy(shard_size=2, devices="cpu")
    hmodel, hopt = train_sharded(hs, batches)
    out["hsdp_diff"] = max_diff(full_state(hmodel), want)
    out["hsdp_bytes"] = local_bytes(hmodel, hopt)
    out["hsdp_placements"] = str(next(hmodel.parameters()).placements)

    # a 2-D mesh: the transformer split over "model", sharded and fed over "data" (FSDP x TP)
    out.update({f"mesh2d_{k}": v for k, v in _mesh_2d(steps_before).items()})
    return out


def _layouts(mesh: Any) -> Any:
    from stratagem.distribute import LayoutMap

    layout = LayoutMap(mesh)
    layout[r"\.(q|k|v|w1)\.weight$"] = ("model", None)
    layout[r"\.(o|w2)\.weight$"] = (None, "model")
    return layout


def _mesh_2d(steps: int) -> dict[str, Any]:
    from stratagem.distribute import DeviceMesh, ModelParallelStrategy

    mesh = DeviceMesh((2, 2), ("data", "model"))
    s = ModelParallelStrategy(mesh, _layouts(mesh), batch_axis="data", devices="cpu")
    torch.manual_seed(0)
    with s.scope():
        model = make_transformer()
        opt = make_adam(model.parameters())
    torch.manual_seed(0)
    out: dict[str, Any] = {"replicas": s.num_replicas_in_sync, "replica": s.extended.replica_id}
    out["init_diff"] = max(max_diff(full_state(model), make_transformer().state_dict()).values())
    out["q_placements"] = str(model[0].q.weight.placements)
    batches = seq_batches(steps)
    stratagem.fit(model, opt, seq_mse, batches, verbose=0)
    want = train_reference(make_transformer, make_adam, seq_mse, batches, seed=0)
    out["adam_diff"] = max_diff(full_state(model), want)
    return out


def fewer_processes(ckpt: str, steps_before: int, steps_after: int) -> dict[str, Any]:
    """Restore a checkpoint written by more processes and keep training."""
    s = stratagem.ShardedStrategy(devices="cpu")
    torch.manual_seed(7)  # different initial values: the checkpoint must replace them
    with s.scope():
        model = make_mlp()
        opt = make_adam(model.parameters())
    stratagem.CheckpointManager(stratagem.Checkpoint(model=model, optimizer=opt), Path(ckpt).parent).restore(ckpt)
    batches = global_batches(steps_before + steps_after)
    for x, y in s.experimental_distribute_dataset(batches[steps_before:]):

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            stratagem.compute_average_loss(mse(model(x), y)).backward()
            opt.step()

        s.run(step, args=(x, y))
    want = train_reference(make_mlp, make_adam, mse, batches, seed=0)
    return {"diff": max_diff(full_state(model), want)}


# --- tensor parallel: a transformer block split over the "model" axis ----------------------------
D, HEAD, HIDDEN, SEQ = 16, 4, 32, 5


class Block(nn.Module):
    """Pre-norm attention + MLP; heads are inferred from the (local) width, so the same code runs
    whole or with q/k/v split column-wise over the model axis."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        # no key bias: softmax ignores it, so its gradient is rounding noise that Adam amplifies
        self.q, self.k, self.v, self.o = nn.Linear(D, D), nn.Linear(D, D, bias=False), nn.Linear(D, D), nn.Linear(D, D)
        self.w1, self.w2 = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, -1, HEAD).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.w2(torch.relu(self.w1(self.norm2(x))))


def make_transformer() -> nn.Module:
    return nn.Sequential(Block(), Block())


def seq_batches(n: int, size: int = 4, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, SEQ, D, generator=g), torch.randn(size, SEQ, D, generator=g)) for _ in range(n)]


def seq_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean(dim=(1, 2))


def tensor_parallel(tmp: str, steps: int) -> dict[str, Any]:
    from stratagem.distribute import DeviceMesh, ModelParallelStrategy

    out: dict[str, Any] = {}
    mesh = DeviceMesh((2,), ("model",))
    s = ModelParallelStrategy(mesh, _layouts(mesh), devices="cpu")
    out["replicas"] = s.num_replicas_in_sync
    torch.manual_seed(0)
    with s.scope():
        model = make_transformer()
        opt = make_adam(model.parameters())
    out["plan"] = s.extended.plans[-1]
    torch.manual_seed(0)
    out["init_diff"] = max(max_diff(full_state(model), make_transformer().state_dict()).values())
    out["local_q_rows"] = model[0].q.weight.to_local().shape[0]
    batches = seq_batches(steps)
    stratagem.fit(model, opt, seq_mse, batches, verbose=0)
    want = train_reference(make_transformer, make_adam, seq_mse, batches, seed=0)
    out["adam_diff"] = max_diff(full_state(model), want)
    ev = stratagem.evaluate(model, seq_mse, batches, return_dict=True)
    out["eval_loss"] = ev["loss"]
    out["ckpt"] = stratagem.CheckpointManager(stratagem.Checkpoint(model=model, optimizer=opt), Path(tmp, "tp")).save(steps)
    return out
