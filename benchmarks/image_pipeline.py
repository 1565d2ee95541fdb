"""Image input pipeline: stratagem.data with default settings vs torch DataLoader, same workers.

uint8 3x128x128 images in memory; per element, with torch ops: random crop to 112, random
horizontal flip, normalize to float32 (the randomness from a per-element numpy Generator, the
same function on both sides); shuffled; batches of 256.

- stratagem: ``from_tensor_slices(images).shuffle(N).map(augment, num_parallel_calls=AUTOTUNE,
  with_rng=True).batch(256).prefetch(AUTOTUNE)`` -- defaults only (AUTOTUNE picks the engine).
- DataLoader: a map-style Dataset running the same function, ``shuffle=True``,
  ``batch_size=256``, ``num_workers=W`` (W = the number of cores, what AUTOTUNE may use).

Each round runs one epoch of each, alternating, first input only (elements/s over the whole
epoch, worker start included on both sides), then with a small CPU training step per batch
(a conv net, SGD). Prints medians and the median of the per-round ratios.

Run: .venv/bin/python benchmarks/image_pipeline.py [--images 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Iterable

import numpy as np
import torch
import torch.utils.data as tud

from stratagem.data import AUTOTUNE, Dataset

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1) * 255
CROP, BATCH = 112, 256


def augment(image: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Random crop 112 + random horizontal flip + normalize, with torch ops."""
    top, left = (int(v) for v in rng.integers(0, image.shape[-1] - CROP + 1, size=2))
    x = image[:, top:top + CROP, left:left + CROP]
    if rng.random() < 0.5:
        x = x.flip(-1)
    return (x.float() - MEAN) / STD


class TorchImages(tud.Dataset):
    def __init__(self, images: torch.Tensor, seed: int) -> None:
        self.images, self.seed = images, seed

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        return augment(self.images[i], np.random.default_rng([self.seed, i]))


def stratagem_pipeline(images: torch.Tensor) -> Dataset:
    return (
        Dataset.from_tensor_slices(images)
        .shuffle(len(images))
        .map(augment, num_parallel_calls=AUTOTUNE, with_rng=True)
        .batch(BATCH)
        .prefetch(AUTOTUNE)
    )


def make_step() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 5, stride=4), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def epoch(batches: Iterable[torch.Tensor], train: bool) -> float:
    """Elements/s over one epoch (optionally a training step per batch)."""
    model, opt = make_step() if train else (None, None)
    start, n = time.perf_counter(), 0
    for x in batches:
        if model is not None and opt is not None:
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        n += len(x)
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="  [log] %(message)s")
    torch.manual_seed(0)
    images = torch.randint(0, 256, (args.images, 3, 128, 128), dtype=torch.uint8)
    ds = stratagem_pipeline(images)
    loader = tud.DataLoader(TorchImages(images, 0), batch_size=BATCH, shuffle=True,
                            num_workers=args.workers)
    print(f"{args.images} images 3x128x128 uint8 -> crop {CROP} + flip + normalize, batch "
          f"{BATCH}; DataLoader num_workers={args.workers}; cores {os.cpu_count()}; torch "
          f"{torch.__version__}")
    for train in (False, True):
        ours, theirs = [], []
        for _ in range(args.rounds):
            theirs.append(epoch(loader, train))
            ours.append(epoch(ds, train))
        ratio = statistics.median(o / t for o, t in zip(ours, theirs))
        label = "with a training step" if train else "input only"
        print(f"\n{label:<24}{'elements/s':>12}")
        print(f"{'DataLoader':<24}{statistics.median(theirs):>12.0f}")
        print(f"{'stratagem (defaults)':<24}{statistics.median(ours):>12.0f}")
        print(f"ratio stratagem/DataLoader: {ratio:.2f}x (median of {args.rounds} alternated "
              f"rounds: {', '.join(f'{o / t:.2f}' for o, t in zip(ours, theirs))})")


if __name__ == "__main__":
    main()
