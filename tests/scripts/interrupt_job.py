"""A user's training job that runs until it is stopped: `python interrupt_job.py MODE DIR`.

MODE "mirrored": MirroredStrategy(2), a step of a few ms, a checkpoint every 3 steps (so Ctrl-C
lands in start-up, in a collective or in a save); "pipeline": PipelineStrategy(2 stages, 4
micro-batches), so it lands in a send or a receive. Prints READY once it trains (the trial driver
uses it only to know the job started). scripts/interrupt_trials.py signals it at random moments.
"""

import contextlib
import os
import sys
import time

import torch
from torch import nn

import stratagem as sg

mode, directory = sys.argv[1], sys.argv[2]
# when `import torch` returned (CLOCK_MONOTONIC: the same clock in every process here). A Ctrl-C
# before this is torch's to lose (docs/MULTIWORKER.md, "Stopping a job"): the trials tell it apart
with contextlib.suppress(FileExistsError), open(os.path.join(directory, "torch-imported"), "x") as f:
    f.write(repr(time.monotonic()))
g = torch.Generator().manual_seed(0)
batches = [(torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(8)]

if mode == "pipeline":
    strategy = sg.PipelineStrategy(num_stages=2, num_microbatches=4, devices="cpu")
    with strategy.scope():
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        pipe = strategy.pipeline(model, nn.CrossEntropyLoss(), verbose=False)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    step = 0
    while True:
        for x, y in strategy.experimental_distribute_dataset(batches):
            loss = strategy.run(pipe.train_step, args=(x, y))
            opt.step()
            opt.zero_grad()
            if step == 0 and strategy.extended.should_checkpoint:
                print("READY", flush=True)
            step += 1
else:
    strategy = sg.MirroredStrategy("cpu", num_replicas=2)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss(reduction="none")

    def train_step(x, y):
        opt.zero_grad()
        loss = sg.compute_average_loss(loss_fn(model(x), y))
        loss.backward()
        opt.step()
        return loss.detach()

    manager = sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=opt), directory, max_to_keep=2)
    step = 0
    while True:
        for x, y in strategy.experimental_distribute_dataset(batches):
            strategy.reduce("sum", strategy.run(train_step, args=(x, y)))
            step += 1
            if step % 3 == 0:
                manager.save(step)
            if step == 1 and strategy.extended.should_checkpoint:
                print("READY", flush=True)
