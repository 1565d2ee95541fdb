"""The README example, runnable: `python examples/quickstart.py`."""

import torch
from torch import nn

import stratagem as sg

strategy = sg.MirroredStrategy("cpu", num_replicas=2)  # 2 CPU replicas ("cuda": one per GPU); starts replica 1 itself
with strategy.scope():                                 # what is created here is mirrored
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = nn.CrossEntropyLoss(reduction="none")

@sg.function                              # graph mode: torch.compile once it pays (jit_compile=True: at once)
def train_step(x, y):
    optimizer.zero_grad()
    loss = sg.compute_average_loss(loss_fn(model(x), y))   # sum / global batch size
    loss.backward()                                    # gradients summed across replicas, in buckets
    optimizer.step()
    return loss.detach()

g = torch.Generator().manual_seed(0)                  # every replica sees the same global batches
data = [(torch.randn(64, 20, generator=g), torch.randint(0, 2, (64,), generator=g)) for _ in range(10)]
for x, y in strategy.experimental_distribute_dataset(data):   # each replica gets its half
    loss = strategy.reduce("sum", strategy.run(train_step, args=(x, y)))
print(f"loss {float(loss):.4f}") if strategy.extended.should_checkpoint else None
