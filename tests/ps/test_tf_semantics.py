"""ParameterServerStrategy as TensorFlow's parameter-server tutorial writes it, in one job
(a chief, 1 worker, 1 ps):

- the custom training loop's ``accuracy = Accuracy()`` made in ``strategy.scope()`` and updated in
  the scheduled ``replica_fn`` reads, on the chief after ``coordinator.join()``, what one process
  computes (tf keeps it in variables on the ps tasks; here each function's update comes back with
  its result, once per function that ran);
- a failed ``fit``'s error is raised by that fit only: the next, unrelated ``schedule`` /
  ``join`` / ``fetch`` calls do not raise it again;
- tf's ClusterCoordinator error rules in a custom loop: the first error is raised by the next
  ``join``, the functions still queued are cancelled (``CancelledError``), and it is raised once.
"""

from __future__ import annotations

import pytest

from stratagem.testing import run_script

pytest.importorskip("cloudpickle")

TUTORIAL = r'''
import torch
from torch import nn

import stratagem as sg

strategy = sg.ParameterServerStrategy()

NUM_BATCHES, BATCH = 21, 8


def dataset_fn():
    g = torch.Generator().manual_seed(0)
    w = torch.tensor([1.0, -2.0, 0.5, 1.5])
    out = []
    for _ in range(NUM_BATCHES):
        x = torch.randn(BATCH, 4, generator=g)
        out.append((x, (x @ w + 0.3 * torch.randn(BATCH, generator=g) > 0).long()))
    return out


# --- the tutorial's custom training loop, as written ------------------------------------------
with strategy.scope():
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())          # tf.keras.layers.Dense(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    accuracy = sg.metrics.Accuracy()
    examples = sg.metrics.Sum()                                    # each example counted once

initial = {k: v.clone() for k, v in model.state_dict().items()}


def step_fn(iterator):
    def replica_fn(batch_data, labels):
        optimizer.zero_grad()
        pred = model(batch_data).squeeze(1)
        per_example_loss = nn.functional.binary_cross_entropy(pred, labels.float(), reduction="none")
        loss = sg.compute_average_loss(per_example_loss)
        loss.backward()
        optimizer.step()
        actual_pred = (pred > 0.5).long()
        accuracy.update_state(labels, actual_pred)
        examples.update_state(torch.tensor(float(len(labels))))
        return loss.detach()

    batch_data, labels = next(iterator)
    losses = strategy.run(replica_fn, args=(batch_data, labels))
    return strategy.reduce("SUM", losses, axis=None)


coordinator = sg.coordinator.ClusterCoordinator(strategy)
per_worker_dataset = coordinator.create_per_worker_dataset(dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

got = []
num_epochs = 4
steps_per_epoch = 5
for i in range(num_epochs):
    accuracy.reset_state()
    for _ in range(steps_per_epoch):
        coordinator.schedule(step_fn, args=(per_worker_iterator,))
    # Wait at epoch boundaries.
    coordinator.join()
    print("Finished epoch %d, accuracy is %f." % (i, float(accuracy.result())))
    got.append(float(accuracy.result()))
loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
print("Final loss is %f" % float(loss.fetch()))  # fetch adds that step's update too
final_accuracy = float(accuracy.result())

# the same loop in one process
ref = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
ref.load_state_dict(initial)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
ref_acc = sg.metrics.Accuracy()
want = []
for step, (x, y) in enumerate(dataset_fn()):
    if step % steps_per_epoch == 0 and step < num_epochs * steps_per_epoch:
        ref_acc.reset_state()
    ref_opt.zero_grad()
    pred = ref(x).squeeze(1)
    nn.functional.binary_cross_entropy(pred, y.float()).backward()
    ref_opt.step()
    ref_acc.update_state(y, (pred > 0.5).long())
    if step % steps_per_epoch == steps_per_epoch - 1:
        want.append(float(ref_acc.result()))
print("RESULT metric", got == want, abs(final_accuracy - float(ref_acc.result())) < 1e-12,
      float(examples.result()) == NUM_BATCHES * BATCH, got, want)

# --- a fit that fails, then unrelated calls ---------------------------------------------------
class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(4, 1)

    def forward(self, x):
        if (x == 999).any():
            raise ValueError("a bad batch")
        return self.dense(x)


with strategy.scope():
    fragile = Fragile()
    fragile_opt = torch.optim.SGD(fragile.parameters(), lr=0.1)
data = [(torch.ones(4, 4), torch.ones(4, 1)) for _ in range(6)]
data[2] = (torch.full((4, 4), 999.0), torch.ones(4, 1))
try:
    sg.fit(fragile, fragile_opt, "mse", data, epochs=2, steps_per_epoch=4, verbose=0)
    print("RESULT fit did not fail")
except ValueError as e:
    print("RESULT fit failed:", str(e).splitlines()[0])
after = []
for call in ("schedule", "join", "schedule+fetch", "join"):
    try:
        if call == "schedule":
            coordinator.schedule(lambda: 1)
        elif call == "join":
            coordinator.join()
        else:
            assert coordinator.schedule(lambda: 2).fetch() == 2
        after.append("ok")
    except Exception as e:
        after.append(f"{type(e).__name__}: {e}")
print("RESULT after fit", after)

# --- tf's rules in a custom loop: raised once, at the next join; the queued rest cancelled ------
bad = coordinator.schedule(lambda: 1 / 0)
rest = [coordinator.schedule(lambda: 3) for _ in range(20)]
try:
    coordinator.join()
    print("RESULT join did not raise")
except ZeroDivisionError:
    pass
outcomes = set()
for v in rest:
    try:
        outcomes.add(v.fetch())
    except sg.coordinator.CancelledError:
        outcomes.add("cancelled")
coordinator.join()  # not raised again
print("RESULT custom loop", "raised once", sorted(map(str, outcomes)), coordinator.schedule(lambda: 4).fetch())
'''


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_tutorials_metric_and_errors_of_one_fit_as_tf(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TUTORIAL)
    argv = ["-m", "stratagem", "run", "--workers", "1", "--ps", "1", "--grace-period", "20", str(script)]
    r = run_script(argv, timeout=140)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
    assert lines[0].startswith("RESULT metric True True True"), r.stdout
    assert lines[1].startswith("RESULT fit failed: a bad batch (raised by the scheduled function on worker:0"), r.stdout
    assert lines[2] == "RESULT after fit ['ok', 'ok', 'ok', 'ok']", r.stdout
    assert lines[3].startswith("RESULT custom loop raised once"), r.stdout
    assert lines[3].endswith(" 4"), r.stdout
    assert set(eval(lines[3].split("raised once ")[1].rsplit(" ", 1)[0])) <= {"3", "cancelled"}, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
