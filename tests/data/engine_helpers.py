"""Module-level functions and pipelines for the batch-building worker tests."""

from __future__ import annotations

import numpy as np
import torch

from stratagem.data import Dataset

IMAGES = torch.arange(40 * 3 * 6 * 6, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(
    40, 3, 6, 6)


def augment(image: torch.Tensor, label: int, rng: np.random.Generator) -> tuple:
    """Random crop 4 + flip + normalize, with torch ops (a small image augmentation)."""
    top, left = (int(v) for v in rng.integers(0, 3, size=2))
    x = image[:, top:top + 4, left:left + 4]
    if rng.random() < 0.5:
        x = x.flip(-1)
    return (x.float() - 127.5) / 64.0, label


def jitter(x: torch.Tensor, label: int, rng: np.random.Generator) -> dict:
    return {"x": x + float(rng.random()), "label": label, "name": f"img{label}"}


def images(processes: bool | None, batch: int = 8, deterministic: bool | None = None,
           drop: bool = False) -> Dataset:
    """images -> map(augment) -> map(jitter) -> batch: the fused segment when on processes."""
    return (
        Dataset.from_tensor_slices((IMAGES, torch.arange(40)))
        .map(augment, num_parallel_calls=2 if processes is not None else None, with_rng=True,
             seed=11, use_processes=processes, deterministic=deterministic)
        .map(jitter, with_rng=True, seed=12)
        .batch(batch, drop_remainder=drop)
    )


def images_processes() -> Dataset:
    return images(True)


def images_unbatched() -> Dataset:
    return images(True, batch=6).unbatch()


def ragged(x: int) -> np.ndarray:
    x = int(x)  # range() yields int64 tensors, as tf.data's does
    return np.arange(x % 5, dtype=np.int32) + x


def fail_at(bad: int, x: torch.Tensor, label: int) -> tuple:
    if int(label) == bad:
        raise KeyError(f"bad image {bad}")
    return x, label


def slow_square(x: int) -> torch.Tensor:
    total = 0
    for i in range(20_000):
        total += i % 7
    return torch.tensor([x * x, total])


def py_work(x: int) -> int:
    total = 0
    for i in range(30_000):
        total = (total * 31 + i) % 1_000_003
    return total + x


def sleepy(x: int) -> int:
    import time

    time.sleep(0.002)
    return x


def fresh_tensor(x: int) -> tuple:
    """Elements made after the workers were forked (they travel through a shared arena)."""
    x = int(x)  # range() yields int64 tensors, as tf.data's does
    return torch.full((2, 3), float(x)), np.arange(4, dtype=np.int16) * x, np.arange(x % 3), x


def combine(t: torch.Tensor, a: np.ndarray, ragged: np.ndarray, x: int,
            rng: np.random.Generator) -> dict:
    # the map before returned numpy arrays: tf.data (and stratagem) hand tensors on
    return {"t": t * float(rng.random()), "a": torch.as_tensor(a) + 1, "n": int(ragged.sum()),
            "x": x}
