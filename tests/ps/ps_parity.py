"""One chief + N workers + P ps (TF_CONFIG from the environment): a model with an embedding
table and an MLP trained by scheduled functions; with one worker it must equal one process."""

import copy
import sys

import torch
from torch import nn

import stratagem as sg

STEPS, BATCH, VOCAB, DIM = 12, 16, 50, 8


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(3 * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).flatten(1)).squeeze(1)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (STEPS * BATCH, 3), generator=g)
    y = torch.randn(STEPS * BATCH, generator=g)
    return [(ids[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(STEPS)]


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    # an embedding updated row by row wants an optimizer that takes sparse gradients
    return torch.optim.Adagrad(model.parameters(), lr=0.1)


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "sgd"
    partitioner = sg.partitioners.FixedShardsPartitioner(2)
    strategy = sg.ParameterServerStrategy(variable_partitioner=partitioner)
    torch.manual_seed(0)
    reference = Model()
    torch.manual_seed(0)
    with strategy.scope():
        model = Model()
        optimizer = make_optimizer(model, kind)
    coordinator = sg.coordinator.ClusterCoordinator(strategy)

    def dataset_fn():
        return batches()

    per_worker = coordinator.create_per_worker_dataset(dataset_fn)
    iterator = iter(per_worker)

    def step_fn(it):
        def replica_fn(ids, y):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(ids), y)
            loss.backward()
            optimizer.step()
            return loss

        ids, y = next(it)
        loss = strategy.run(replica_fn, args=(ids, y))
        return strategy.reduce("SUM", loss, axis=None)

    losses = [coordinator.schedule(step_fn, args=(iterator,)) for _ in range(STEPS)]
    coordinator.join()
    got = [float(v.fetch()) for v in losses]

    ref_opt = make_optimizer(reference, kind)
    want = []
    for ids, y in batches():
        ref_opt.zero_grad()
        loss = nn.functional.mse_loss(reference(ids), y)
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    state = model.state_dict()  # the chief reads the variables from the ps tasks
    diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    loss_diff = max(abs(a - b) for a, b in zip(got, want))
    print(f"RESULT param_diff={diff:.3g} loss_diff={loss_diff:.3g} lost={coordinator.lost_workers}")
    assert diff < 1e-5 and loss_diff < 1e-5, (diff, loss_diff, got, want)
    _ = copy


if __name__ == "__main__":
    main()
