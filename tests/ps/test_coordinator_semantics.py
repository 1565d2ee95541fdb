"""The coordinator's semantics, each a minimal job (two were bugs once):

- ``ClusterCoordinator(strategy)`` is one per strategy (as tf), and per-worker datasets are
  numbered per strategy: a coordinator made after another (``fit`` makes one) gets its own.
- A bare ``model(x)`` on the chief after training computes with the variables' current values
  (as tf reads them on the coordinator), like ``strategy.run`` and ``state_dict()``."""

from __future__ import annotations

import pytest

from stratagem.testing import run_script

pytest.importorskip("cloudpickle")

TWO_COORDINATORS = """
import stratagem as sg

strategy = sg.ParameterServerStrategy()
first = sg.coordinator.ClusterCoordinator(strategy)
it = iter(first.create_per_worker_dataset(lambda: [1, 2, 3]))
assert first.schedule(lambda i: next(i), args=(it,)).fetch() == 1
first.close()
second = sg.coordinator.ClusterCoordinator(strategy)  # as fit makes its own
it = iter(second.create_per_worker_dataset(lambda: ["a", "b"]))
got = second.schedule(lambda i: next(i), args=(it,)).fetch()
print("RESULT", got)
"""


@pytest.mark.slow  # a second coordinator's datasets: in the slow tier (CI runs it): the main tier under 15 minutes
@pytest.mark.timeout(120)
def test_a_second_coordinator_gets_its_own_per_worker_datasets(tmp_path):
    r = _job(tmp_path, TWO_COORDINATORS)
    assert "RESULT a" in r.stdout, r.stdout


STALE_READ = """
import torch
import stratagem as sg

strategy = sg.ParameterServerStrategy()
with strategy.scope():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
coordinator = sg.coordinator.ClusterCoordinator(strategy)
x = torch.ones(2, 4)
before = model(x).detach().clone()

def step():
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()

for _ in range(3):
    coordinator.schedule(step)
coordinator.join()
bare = model(x).detach().clone()  # the chief reads the variables here, as in tf
current = strategy.run(lambda: model(x).detach())  # refreshes from the ps tasks first
print("RESULT", bool(torch.equal(bare, before)), bool(torch.allclose(bare, current)))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_chief_reads_current_values_in_a_bare_forward(tmp_path):
    r = _job(tmp_path, STALE_READ)
    assert "RESULT False True" in r.stdout, r.stdout


def _job(tmp_path, code: str):
    script = tmp_path / "job.py"
    script.write_text(code)
    argv = ["-m", "stratagem", "run", "--workers", "1", "--ps", "1", "--grace-period", "20", str(script)]
    r = run_script(argv, timeout=100)
    assert r.returncode == 0, r.stderr
    return r


METRIC_SHIPPED = """
import torch
import stratagem as sg

strategy = sg.ParameterServerStrategy()
coordinator = sg.coordinator.ClusterCoordinator(strategy)
metric = sg.metrics.Mean()
metric.update_state(torch.tensor([1.0, 3.0]))  # on the chief, outside any scope
totals = coordinator.schedule(lambda: metric.batch_totals(torch.tensor([5.0]))).fetch()
metric.add_totals(totals)
print("RESULT", float(metric.result()))
"""


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_metric_the_chief_updated_ships_to_a_worker(tmp_path):
    r = _job(tmp_path, METRIC_SHIPPED)
    assert "RESULT 3.0" in r.stdout, r.stdout
