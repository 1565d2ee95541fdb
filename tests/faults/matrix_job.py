"""One process of a job the fault matrix breaks (tests/faults/matrix.py), written as a user would.

    stratagem run -n N matrix_job.py KIND DIR        KIND: multiworker | sharded | pipeline
    python matrix_job.py mirrored DIR                 (MirroredStrategy(["cpu", "cpu"]) starts its replica)
    TF_CONFIG=... python matrix_job.py ps DIR         (chief, workers and a ps task, each started so)

Every rank prints ``RANK <name> PID <pid>`` first and ``STEP <name> <i>`` every 5 steps, and
trains until told otherwise: the harness kills or stops a process itself, cuts its host off, or
asks for an error by creating ``DIR/raise-<name>`` (the rank raises between steps) or
``DIR/raise-in-step-<name>`` (a layer raises in the forward). ``DIR/finish-chief`` ends a
parameter-server job's training (after a lost worker, to see every task end cleanly). With ``DIR/save-every`` present
(holding N) the job saves a checkpoint into ``DIR/ckpt`` every N steps and prints ``SAVING <i>``
before each save. ``DIR/steps`` (holding N) ends training after N steps with ``DONE``;
``DIR/width`` makes the model wider, ``DIR/timeout`` sets the collectives' timeout (seconds).
Under MultiWorkerMirroredStrategy a process may also be started alone with its TF_CONFIG. Names:
``worker <r>`` (``stage <r>`` in a pipeline); under ParameterServerStrategy ``chief``,
``worker <i>``, ``ps <i>``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import stratagem as sg
from stratagem.distribute.strategies.pipeline import PipelineStrategy

kind, folder = sys.argv[1], Path(sys.argv[2])


def say(line: str) -> None:
    """One line in one write: two replicas share one pipe (print writes the line and its end apart)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def asked(what: str, name: str) -> bool:
    return (folder / f"{what}-{name}").exists()


def number(what: str) -> int | None:
    p = folder / what
    return int(p.read_text()) if p.exists() else None


class Breaks(nn.Module):
    """Passes its input through; raises in the forward once its rank is asked to."""

    def __init__(self, name: str = "") -> None:
        super().__init__()
        self.name = name

    def forward(self, x):
        if self.name and asked("raise-in-step", self.name):
            raise ValueError(f"broken on purpose in the forward on {self.name}")
        return x


class BreaksThen(Breaks):
    """A layer (one pipeline chunk, not flattened) that breaks before it when asked to."""

    def __init__(self, name: str, layer: nn.Module) -> None:
        super().__init__(name)
        self.layer = layer

    def forward(self, x):
        return self.layer(super().forward(x))


def task_name() -> str:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return "chief" if task["type"] == "chief" else f"{task['type']} {task['index']}"


g = torch.Generator().manual_seed(1)
X, Y = torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g)
steps = number("steps") or 10**9
save_every = number("save-every")
width = number("width") or 16  # DIR/width: a wider model, whose gradients take a slow link seconds
timeout = number("timeout")  # DIR/timeout: CommunicationOptions(timeout_seconds=...)
options = sg.CommunicationOptions(timeout_seconds=timeout) if timeout else None


def ps_job() -> None:
    name = task_name()
    say(f"RANK {name} PID {os.getpid()}")
    strategy = sg.ParameterServerStrategy()  # workers and ps tasks serve here until the chief ends
    with strategy.scope():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    coordinator = sg.coordinator.ClusterCoordinator(strategy)

    def step_fn():
        here = task_name()  # runs on a worker
        if asked("raise-in-step", here):
            raise ValueError(f"broken on purpose in a function on {here}")
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X), Y)
        loss.backward()
        opt.step()
        return loss.item()

    for i in range(steps):
        if asked("raise", name):
            raise ValueError("broken on purpose between steps on the chief")
        if asked("finish", name):
            break
        coordinator.schedule(step_fn).fetch()
        if i % 5 == 0:
            say(f"STEP {name} {i}")
        time.sleep(0.01)
    coordinator.join()
    say(f"DONE {name}")


def collective_job() -> None:
    breaks = Breaks()
    if timeout:  # imports done: the clock of a "never" case starts here, not at the fork
        say(f"READY {task_name()}")
    if kind == "mirrored":  # rank 0 starts its second replica itself
        strategy = sg.MirroredStrategy(["cpu", "cpu"])
    elif kind == "multiworker":
        strategy = sg.MultiWorkerMirroredStrategy(communication_options=options)
    elif kind == "sharded":
        strategy = sg.ShardedStrategy()
    elif kind == "pipeline":
        strategy = PipelineStrategy(3, 6, schedule="interleaved_1f1b", balance=[1] * 6, devices="cpu")
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    torch.manual_seed(0)
    if kind == "pipeline":
        rank = strategy.stage
        name = f"stage {rank}"
        # chunk c of the interleaved plan lives on stage c % 3: chunks 0, 1, 2 start with a layer
        # that breaks when its stage is asked to (the same model on every process)
        layers: list[nn.Module] = [BreaksThen(f"stage {c}", nn.Linear(8 if c == 0 else 16, 16)) for c in range(3)]
        layers += [nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 3)]
        with strategy.scope():
            pipe = strategy.pipeline(nn.Sequential(*layers), nn.CrossEntropyLoss(), verbose=False)
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        state: dict = {"model": pipe, "optimizer": opt}
        x, y = X, Y

        def train_step():
            loss = strategy.run(pipe.train_step, args=(x, y))
            opt.step()
            opt.zero_grad()
            return loss
    else:
        rank = strategy.extended.replica_id
        name = f"worker {rank}"
        with strategy.scope():
            model = nn.Sequential(nn.Linear(8, width), breaks, nn.Tanh(), nn.Linear(width, width), nn.Linear(width, 3))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = {"model": model, "optimizer": opt}
        n = strategy.num_replicas_in_sync
        x, y = X.chunk(n)[rank], Y.chunk(n)[rank]

        def step():
            opt.zero_grad()
            loss = sg.compute_average_loss(nn.functional.cross_entropy(model(x), y, reduction="none"),
                                           global_batch_size=24)
            loss.backward()
            opt.step()
            return loss

        def train_step():
            return strategy.run(step)
    breaks.name = name if kind != "pipeline" else ""
    say(f"RANK {name} PID {os.getpid()}")
    manager = sg.CheckpointManager(sg.Checkpoint(**state), folder / "ckpt") if save_every else None
    for i in range(steps):
        if asked("raise", name):
            raise ValueError(f"broken on purpose between steps on {name}")
        train_step()
        if manager is not None and save_every and (i + 1) % save_every == 0:
            say(f"SAVING {name} {i + 1}")
            manager.save(i + 1)
        if i % 5 == 0 or width > 16:
            say(f"STEP {name} {i}")
        time.sleep(0.01)
    say(f"DONE {name}")


if kind == "ps":
    ps_job()
else:
    collective_job()
