"""The main job: a small convnet on scikit-learn's digits, MirroredStrategy on 2 replicas (one per GPU
when the machine has 2, else on the CPU; ``--devices`` chooses)."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

import stratagem as sg
from stratagem.data import Dataset


def load_digits_split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 1,797 8x8 digit images scikit-learn ships, split 80/20 with a fixed seed."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover
        raise SystemExit("the demo needs scikit-learn: pip install 'stratagem[demo]'") from e
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    x, y = x[order], y[order]
    n_train = int(0.8 * len(y))
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def make_convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def global_batches(x: torch.Tensor, y: torch.Tensor, batch: int, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1000 + epoch))
    return [(x[order[i : i + batch]], y[order[i : i + batch]]) for i in range(0, len(y), batch)]


def demo_devices(replicas: int, devices: str | None) -> str:
    """The demo's choice: one replica per GPU when the machine has a GPU for each, else CPU
    replicas (a laptop or a one-GPU workstation runs the 2-replica demo on its CPU cores)."""
    if devices is not None:
        return devices
    return "cuda" if torch.cuda.device_count() >= replicas else "cpu"


def run_demo(
    replicas: int = 2, epochs: int = 12, batch_size: int = 64, plot: str | None = None,
    custom_loop: bool = False, devices: str | None = None,
) -> int:
    """Train on 80% of the digits and print the held-out accuracy (about 0.98 after the default 12
    epochs, less after fewer). The exit code is 0 whenever the run itself worked: the accuracy is
    printed for the reader, not turned into a pass mark."""
    strategy = sg.MirroredStrategy(demo_devices(replicas, devices), num_replicas=replicas)
    chief = strategy.extended.should_checkpoint
    x_train, y_train, x_test, y_test = load_digits_split()
    torch.manual_seed(0)
    with strategy.scope():
        model = make_convnet()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    if chief:
        print(f"stratagem demo: digits ({len(y_train)} train / {len(y_test)} held out), "
              f"{strategy.num_replicas_in_sync} replicas on {', '.join(strategy.devices)}, global batch {batch_size}"
              f"{', custom loop' if custom_loop else ''}", flush=True)
    if custom_loop:
        accuracy = _custom_loop(strategy, model, optimizer, (x_train, y_train, x_test, y_test), epochs, batch_size)
    else:
        train_data = Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(y_train), seed=0).batch(batch_size)
        test_data = Dataset.from_tensor_slices((x_test, y_test)).batch(256)
        history = sg.fit(model, optimizer, nn.CrossEntropyLoss(), train_data, epochs=epochs,
                         validation_data=test_data, metrics=["sparse_categorical_accuracy"], strategy=strategy)
        _, accuracy = sg.evaluate(model, nn.CrossEntropyLoss(), test_data, metrics=["sparse_categorical_accuracy"],
                                  strategy=strategy)  # [loss, *metrics], as Keras's evaluate
        if chief and plot:
            try:
                print(f"wrote {history.plot(plot)}", flush=True)
            except ImportError as e:
                print(f"no plot: {e}", flush=True)
    if chief:
        print(f"final held-out accuracy {accuracy:.4f} after {epochs} epoch{'s' if epochs != 1 else ''}",
              flush=True)
    return 0


def _custom_loop(
    strategy: sg.Strategy, model: nn.Module, optimizer: torch.optim.Optimizer,
    split: tuple[torch.Tensor, ...], epochs: int, batch_size: int,
) -> float:
    """The same training written by hand: run, compute_average_loss, reduce."""
    x_train, y_train, x_test, y_test = split
    chief = strategy.extended.should_checkpoint
    loss_fn = nn.CrossEntropyLoss(reduction="none")

    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        optimizer.zero_grad()
        logits = model(x)
        loss = sg.compute_average_loss(loss_fn(logits, y))
        loss.backward()
        optimizer.step()
        return loss_fn(logits, y).detach().sum(), (logits.argmax(1) == y).sum()

    def eval_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return (model(x).argmax(1) == y).sum()

    accuracy = 0.0
    for epoch in range(epochs):
        start = time.perf_counter()
        loss_sum = torch.zeros(())
        correct = torch.zeros((), dtype=torch.int64)
        for x, y in strategy.experimental_distribute_dataset(global_batches(x_train, y_train, batch_size, epoch)):
            loss, right = strategy.run(train_step, args=(x, y))
            loss_sum += loss
            correct += right
        loss_total, correct_total = strategy.reduce("sum", (loss_sum, correct))
        seconds = time.perf_counter() - start
        test = strategy.experimental_distribute_dataset(global_batches(x_test, y_test, 256, 0))
        held_out = sum((strategy.run(eval_step, args=(x, y)) for x, y in test), torch.zeros((), dtype=torch.int64))
        accuracy = float(strategy.reduce("sum", held_out)) / len(y_test)
        if chief:
            print(f"epoch {epoch + 1:2d}/{epochs}  loss {float(loss_total) / len(y_train):.4f}  "
                  f"accuracy {float(correct_total) / len(y_train):.4f}  held-out accuracy {accuracy:.4f}  "
                  f"{len(y_train) / seconds:,.0f} samples/s", flush=True)
    return accuracy
