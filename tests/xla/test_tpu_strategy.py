"""TPUStrategy on XLA's CPU backend (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=2 or 4): the bootstrap,
parity with plain CPU torch on the global batch (initial weights included, partial last batch),
reductions, one compilation for the steady step, checkpoints portable to MirroredStrategy."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.distribute.engines import xla as xla_engine

N = int(os.environ.get("CPU_NUM_DEVICES", "1"))
TOL = 1e-5


@pytest.fixture(scope="module")
def strategy():
    # the bootstrap exactly as docs/STRATEGIES.md writes it
    resolver = sg.cluster_resolver.TPUClusterResolver(tpu=None)
    sg.connect_to_cluster(resolver)
    sg.initialize_tpu_system(resolver)
    strategy = sg.TPUStrategy(resolver)
    return strategy


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(n: int = 38, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def reference(x, y, batch, epochs=1, lr=0.1, momentum=0.9):
    """Plain CPU torch on the global batches: the single-device baseline."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for _ in range(epochs):
        for i in range(0, len(x), batch):
            loss = nn.functional.mse_loss(model(x[i : i + batch]), y[i : i + batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return model, losses


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach().cpu() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def test_bootstrap(strategy):
    assert strategy.num_replicas_in_sync == N
    assert strategy.extended.device.type == "xla"
    # idempotent: the same runtime again
    again = sg.initialize_tpu_system(sg.cluster_resolver.TPUClusterResolver(tpu="local"))
    assert again is strategy.extended.runtime


def test_custom_loop_equals_cpu_training_with_a_partial_last_batch(strategy):
    x, y = data(38)  # batches of 8: 8, 8, 8, 8, 6 (6 does not divide 4 devices evenly)
    with strategy.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert sg.strategy_of(model) is strategy
    assert all(p.device.type == "xla" for p in model.parameters())
    assert max_diff(model, make_model()) == 0.0  # the CPU generator's initial weights

    def step(batch):
        xb, yb = batch
        per_example = ((model(xb) - yb) ** 2).mean(dim=1)
        loss = sg.compute_average_loss(per_example)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    dist = strategy.experimental_distribute_dataset(sg.data.Dataset.from_tensor_slices((x, y)).batch(8))
    losses = []
    for _ in range(2):
        for batch in dist:
            losses.append(float(strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None).detach()))
    ref, ref_losses = reference(x, y, 8, epochs=2)
    assert max_diff(model, ref) < TOL
    assert losses == pytest.approx(ref_losses, abs=TOL)


def test_fit_evaluate_predict_equal_cpu_training(strategy):
    x, y = data(38, seed=3)
    with strategy.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ds = sg.data.Dataset.from_tensor_slices((x, y)).batch(8)
    history = sg.fit(model, opt, nn.MSELoss(), ds, epochs=2, steps_per_execution=1, verbose=0)
    ref, ref_losses = reference(x, y, 8, epochs=2)
    assert max_diff(model, ref) < TOL
    # the epoch loss: mean over the examples of the epoch
    sizes = [8, 8, 8, 8, 6]
    epoch2 = sum(loss * s for loss, s in zip(ref_losses[5:], sizes)) / 38
    assert history.history["loss"][-1] == pytest.approx(epoch2, abs=TOL)
    with torch.no_grad():
        want = nn.functional.mse_loss(ref(x), y).item()
        pred = ref(x)
    logs = sg.evaluate(model, nn.MSELoss(), ds, return_dict=True)
    assert logs["loss"] == pytest.approx(want, abs=TOL)
    out = sg.predict(model, sg.data.Dataset.from_tensor_slices(x).batch(8))
    assert torch.allclose(torch.as_tensor(out).cpu(), pred, atol=TOL)


def test_reduce_gather_and_local_results(strategy):
    x = torch.arange(10, dtype=torch.float32).reshape(10, 1)  # a partial batch on 4 devices

    def fn(xb):
        return xb * 2, sg.compute_average_loss(xb[:, 0])

    doubled, avg = strategy.run(fn, args=(x,))
    assert float(avg) == pytest.approx(4.5)  # sum / the true global count, 10
    assert torch.equal(strategy.reduce("sum", doubled, axis=0).cpu(), torch.tensor([90.0]))
    assert torch.equal(strategy.reduce("mean", doubled, axis=0).cpu(), torch.tensor([9.0]))
    assert float(strategy.reduce("mean", avg, axis=None)) == pytest.approx(4.5)
    assert torch.equal(strategy.gather(doubled, axis=0).cpu(), x * 2)
    (local,) = strategy.experimental_local_results(doubled)
    assert torch.equal(local.cpu(), x * 2)
    # one program over the global batch: a weight penalty is added once, not divided by N
    penalty = strategy.run(lambda: sg.scale_regularization_loss(torch.tensor(3.0)))
    assert float(penalty) == 3.0
    assert strategy.run(lambda: sg.get_replica_context().num_replicas_in_sync) == N


def test_datasets_from_function_reads_global_batches(strategy):
    x, _ = data(16)
    seen = []

    def dataset_fn(ctx):
        seen.append(ctx.get_per_replica_batch_size(8))
        return sg.data.Dataset.from_tensor_slices(x).batch(ctx.get_per_replica_batch_size(8))

    batches = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert seen == [8]
    assert [b.shape[0] for b in batches] == [8, 8]
    assert torch.equal(torch.cat([b.cpu() for b in batches]), x)


def test_steady_step_compiles_once(strategy):
    x, y = data(64, seed=5)
    with strategy.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(batch):
        xb, yb = batch
        loss = sg.compute_average_loss(((model(xb) - yb) ** 2).mean(dim=1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    dist = strategy.experimental_distribute_dataset(sg.data.Dataset.from_tensor_slices((x, y)).batch(8))
    counts = []
    for batch in dist:
        strategy.run(step, args=(batch,))
        counts.append(xla_engine.compilations())
    # the first steps build the momentum buffers and gradients; from the third on the same graph
    steady = counts[2:]
    assert len(steady) == 6 and len(set(steady)) == 1, counts


def test_checkpoint_round_trip_tpu_mirrored_tpu(strategy, tmp_path):
    x, y = data(32, seed=7)

    def train(strat, model, opt, start, stop):
        def step(xb, yb):
            loss = sg.compute_average_loss(((model(xb) - yb) ** 2).mean(dim=1))
            opt.zero_grad()
            loss.backward()
            opt.step()

        for i in range(start, stop):
            strat.run(step, args=(x[8 * (i % 4) : 8 * (i % 4) + 8], y[8 * (i % 4) : 8 * (i % 4) + 8]))

    def build(strat):
        with strat.scope():
            model = make_model()
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, opt

    # uninterrupted: 6 steps on CPU torch
    ref = make_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for i in range(6):
        loss = nn.functional.mse_loss(ref(x[8 * (i % 4) : 8 * (i % 4) + 8]), y[8 * (i % 4) : 8 * (i % 4) + 8])
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()

    model, opt = build(strategy)
    train(strategy, model, opt, 0, 2)
    sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=opt), tmp_path / "a", strategy=strategy).save(2)

    mirrored = sg.MirroredStrategy("cpu")
    m_model, m_opt = build(mirrored)
    m_manager = sg.CheckpointManager(sg.Checkpoint(model=m_model, optimizer=m_opt), tmp_path / "a", strategy=mirrored)
    assert m_manager.restore_or_initialize() is not None
    train(mirrored, m_model, m_opt, 2, 4)
    sg.CheckpointManager(sg.Checkpoint(model=m_model, optimizer=m_opt), tmp_path / "b", strategy=mirrored).save(4)

    model2, opt2 = build(strategy)
    manager = sg.CheckpointManager(sg.Checkpoint(model=model2, optimizer=opt2), tmp_path / "b", strategy=strategy)
    assert manager.restore_or_initialize() is not None
    train(strategy, model2, opt2, 4, 6)
    assert max_diff(model2, ref) < TOL


def test_a_model_made_outside_the_scope_is_refused(strategy):
    model = make_model()
    with pytest.raises(sg.OutsideScopeError):
        strategy.run(lambda: model(torch.zeros(4, 6)))


def test_a_resolver_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="TPUClusterResolver"):
        sg.TPUStrategy(sg.cluster_resolver.SimpleClusterResolver("127.0.0.1:1234", 1, 0))


def test_the_docs_program_runs_as_written_and_prints_only_its_line(tmp_path):
    import re
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "STRATEGIES.md").read_text()
    section = text[text.index("## TPUStrategy") :]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "train.py"
    script.write_text(block)
    # a fresh user's environment: this process's runtime set XLA_USE_SPMD, which 2.9 warns about
    env = {k: v for k, v in os.environ.items() if k != "XLA_USE_SPMD"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert re.fullmatch(rf"{N} replicas, loss \d+\.\d+\n", done.stdout), done.stdout


def test_initialize_tpu_system_keeps_compiled_programs_in_cache_dir(tmp_path):
    import subprocess
    import sys

    program = f"""
import torch
import stratagem as sg
resolver = sg.cluster_resolver.TPUClusterResolver(tpu=None)
sg.initialize_tpu_system(resolver, cache_dir={str(tmp_path / "cache")!r})
strategy = sg.TPUStrategy(resolver)
with strategy.scope():
    model = torch.nn.Linear(4, 2)
print(float(strategy.run(lambda x: model(x).sum(), args=(torch.ones(8, 4),))))
"""
    env = {k: v for k, v in os.environ.items() if k != "XLA_USE_SPMD"}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr
    assert any((tmp_path / "cache").iterdir())
