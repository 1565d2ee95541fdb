"""A user's training script: `python pipeline_script.py` starts its second stage itself."""

import torch
from torch import nn

from stratagem.distribute.strategies.pipeline import PipelineStrategy

strategy = PipelineStrategy(num_stages=2, num_microbatches=4, schedule="1f1b", devices="cpu")
with strategy.scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    pipe = strategy.pipeline(model, nn.CrossEntropyLoss())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 6, generator=g)
y = (x[:, 0] > 0).long()
losses = []
for _ in range(30):
    loss = strategy.run(pipe.train_step, args=(x, y))
    opt.step()
    opt.zero_grad()
    losses.append(float(strategy.reduce("sum", loss)))
accuracy = float((pipe.predict(x).argmax(1) == y).float().mean())
print(f"stage {strategy.stage}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, accuracy {accuracy:.2f}", flush=True)
