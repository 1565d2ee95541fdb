"""A parameter-server job with Keras's optimizers (`stratagem run --workers 1 --ps 2
ps_keras_optimizers.py KIND`): a recipe of ``sg.optimizers`` built over the model in the scope
steps on the ps tasks exactly as it does in one process (KIND: adam, sgd, rmsprop: Adam, SGD with
momentum, RMSprop with an ExponentialDecay schedule); with a second argument ``fit``, the recipe
given to ``Model.compile`` trains as it does in one process."""

import sys

import torch
from torch import nn

import stratagem as sg

BATCH, STEPS = 8, 10


def recipe(kind: str) -> sg.optimizers.Optimizer:
    if kind == "adam":
        return sg.optimizers.Adam(learning_rate=0.01)
    if kind == "sgd":
        return sg.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    schedule = sg.optimizers.schedules.ExponentialDecay(0.01, decay_steps=2, decay_rate=0.5)
    return sg.optimizers.RMSprop(learning_rate=schedule)


def model_fn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH, 4, generator=g)
    y = x.sum(1, keepdim=True) ** 2
    return [(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(STEPS)]


class KerasModel(sg.Model):
    def __init__(self) -> None:
        super().__init__()
        self.net = model_fn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def fit(strategy: sg.ParameterServerStrategy, kind: str) -> None:
    """The recipe given to ``Model.compile`` (built over the model's parameters there)."""
    reference = KerasModel()
    with strategy.scope():
        model = KerasModel()
    model.compile(optimizer=recipe(kind), loss="mse")
    reference.compile(optimizer=recipe(kind), loss="mse")
    kwargs = dict(epochs=2, steps_per_epoch=STEPS // 2, verbose=0)
    got = model.fit(batches(), **kwargs).history
    want = reference.fit(batches(), **kwargs).history
    diff = max(abs(a - b) for k in got for a, b in zip(got[k], want[k]))
    state = model.state_dict()
    pdiff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    print(f"RESULT history_diff={diff:.3g} param_diff={pdiff:.3g}", flush=True)
    assert diff < 1e-5 and pdiff < 1e-5, (got, want)


def main() -> None:
    kind = sys.argv[1]
    strategy = sg.ParameterServerStrategy(variable_partitioner=sg.partitioners.FixedShardsPartitioner(2))
    if len(sys.argv) > 2 and sys.argv[2] == "fit":
        fit(strategy, kind)
        return
    reference = model_fn()
    ref_opt = recipe(kind).build(reference.parameters())
    with strategy.scope():
        model = model_fn()
        optimizer = recipe(kind).build(model.parameters())
    coordinator = sg.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(lambda ctx: batches()))

    def step_fn(it):
        def replica_fn(x, y):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            return loss

        x, y = next(it)
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(x, y)), axis=None)

    got = [float(coordinator.schedule(step_fn, args=(iterator,)).fetch()) for _ in range(STEPS)]
    want = []
    for x, y in batches():
        ref_opt.zero_grad()
        loss = nn.functional.mse_loss(reference(x), y)
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    state = model.state_dict()
    diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    loss_diff = max(abs(a - b) for a, b in zip(got, want))
    print(f"RESULT param_diff={diff:.3g} loss_diff={loss_diff:.3g}", flush=True)
    assert diff < 1e-5 and loss_diff < 1e-5, (diff, loss_diff)


if __name__ == "__main__":
    main()
