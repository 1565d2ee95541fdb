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

With ``--device cuda`` the consumer is a ResNet-18 training step on the GPU (bf16 autocast,
channels_last, SGD; the model of benchmarks/fit_overhead.py) and three feeds are timed per round,
in training images/s over one epoch: the stratagem pipeline through
``OneDeviceStrategy.experimental_distribute_dataset`` (the device feed), ``DataLoader(num_workers=W,
pin_memory=True)`` with ``non_blocking`` copies, and the bound: the same number of batches already
on the GPU. Prints ``RESULT feed_vs_dataloader=`` and ``RESULT feed_vs_gpu_bound=`` lines.

Run: .venv/bin/python benchmarks/image_pipeline.py [--images 4096] [--rounds 5]
     python benchmarks/image_pipeline.py --device cuda --workers 8   (PYTHONPATH=src on a GPU machine)
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
    parser.add_argument("--device", default="cpu", help="cuda: feed a ResNet-18 step on the GPU")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="  [log] %(message)s")
    torch.manual_seed(0)
    images = torch.randint(0, 256, (args.images, 3, 128, 128), dtype=torch.uint8)
    if args.device != "cpu":
        gpu_main(images, torch.device(args.device), args.workers, args.rounds)
        return
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
    print(f"RESULT image_vs_dataloader_cpu_train={ratio:.4f}")


def gpu_main(images: torch.Tensor, dev: torch.device, workers: int, rounds: int) -> None:
    """Training images/s of a ResNet-18 step on ``dev`` fed three ways (see the module doc)."""
    import stratagem as sg
    from fit_overhead import resnet18  # benchmarks/ is on sys.path when run as a script

    strategy = sg.OneDeviceStrategy(dev)
    with strategy.scope():
        model = resnet18().to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    ys = torch.randint(0, 10, (BATCH,), device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def train(batches: Iterable[torch.Tensor]) -> float:
        n = 0
        sync()
        start = time.perf_counter()
        for x in batches:
            x = x.to(dev, non_blocking=True).contiguous(memory_format=torch.channels_last)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = loss_fn(model(x), ys[: len(x)])
            loss.backward()
            opt.step()
            n += len(x)
        sync()
        return n / (time.perf_counter() - start)

    ds = stratagem_pipeline(images)
    loader = tud.DataLoader(TorchImages(images, 0), batch_size=BATCH, shuffle=True,
                            num_workers=workers, pin_memory=dev.type == "cuda")
    first = iter(loader)
    staged = [next(first).to(dev) for _ in range(min(4, len(loader)))]  # the bound: on the GPU already
    del first
    steps = -(-len(images) // BATCH)
    on_gpu = [staged[i % len(staged)] for i in range(steps)]
    arms = {
        "stratagem (device feed)": lambda: train(strategy.experimental_distribute_dataset(ds)),
        f"DataLoader({workers}, pin_memory)": lambda: train(loader),
        "batches already on GPU": lambda: train(on_gpu),
    }
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    print(f"{len(images)} images 3x128x128 uint8 -> crop {CROP} + flip + normalize, batch {BATCH}, "
          f"ResNet-18 bf16 channels_last on {name}; cores "
          f"{os.cpu_count()}; torch {torch.__version__}")
    for run in arms.values():
        run()  # warm up (cudnn autotune, workers, engine choice)
    results: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, run in arms.items():
            results[name].append(run())
    med = {name: statistics.median(v) for name, v in results.items()}
    print(f"\n{'training images/s':<32}{'median':>10}  rounds")
    for name, v in results.items():
        print(f"{name:<32}{med[name]:>10.0f}  {', '.join(f'{r:.0f}' for r in v)}")
    ours, theirs, bound = (med[name] for name in arms)
    print(f"stratagem / DataLoader: {ours / theirs:.3f}x (target >= 1.0); "
          f"stratagem / on-GPU bound: {ours / bound:.3f} (target >= 0.9)")
    print(f"RESULT feed_vs_dataloader={ours / theirs:.4f}")
    print(f"RESULT feed_vs_gpu_bound={ours / bound:.4f}")


if __name__ == "__main__":
    main()
