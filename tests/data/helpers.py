"""Module-level (picklable) functions and pipelines for the stratagem.data tests."""

from __future__ import annotations

import os

import numpy as np
import torch

from stratagem.data import AUTOTUNE, Dataset

FILES_DIR = os.environ.get("STRATAGEM_TEST_FILES", "")


def square_array(x: int) -> np.ndarray:
    return np.full((3,), x * x, dtype=np.int64)


def noisy(x: int, rng: np.random.Generator) -> torch.Tensor:
    return torch.tensor([float(x), float(rng.random())])


def fail_on_5(x: int) -> int:
    if x == 5:
        raise KeyError("boom")
    return x


def read_lines(path: str) -> Dataset:
    from stratagem.data import TextLineDataset

    return TextLineDataset(path)


def parse(line: str, rng: np.random.Generator) -> torch.Tensor:
    return torch.tensor([float(line.split()[-1]), float(rng.integers(100))])


def representative(files_dir: str, parallel: int | None = 2, processes: bool = False) -> Dataset:
    """list of files -> interleave -> parallel map -> shuffle -> batch -> prefetch."""
    return (
        Dataset.list_files(os.path.join(files_dir, "*.txt"), seed=7)
        .interleave(read_lines, cycle_length=2, block_length=3,
                    num_parallel_calls=None if parallel is None else AUTOTUNE)
        .map(parse, num_parallel_calls=parallel, with_rng=True, seed=3,
             use_processes=processes)
        .shuffle(8)
        .batch(4)
        .prefetch(2)
    )


def make_representative() -> Dataset:
    return representative(FILES_DIR)


def write_text_files(directory: str, n_files: int = 4, lines: int = 7) -> list[str]:
    paths = []
    for f in range(n_files):
        path = os.path.join(directory, f"part-{f:02d}.txt")
        with open(path, "w") as fh:
            for i in range(lines):
                fh.write(f"file {f} line {f * 100 + i}\n")
        paths.append(path)
    return paths


def fail_on(bad: int, x: int) -> int:
    """``functools.partial(fail_on, bad)``: raises on element ``bad``."""
    if x == bad:
        raise KeyError(f"boom at {x}")
    return x


class UnpicklableError(Exception):
    def __init__(self, a: str, b: str) -> None:  # pickles, but does not unpickle
        super().__init__(a)
        self.b = b


def raise_unpicklable(x: int) -> int:
    if x == 3:
        raise UnpicklableError("odd", "state")
    return x


def double_leaves(element: dict) -> dict:
    return {"a": element["a"] * 2, "b": (element["b"][0] + 1, str(element["b"][1]))}


def leaves_of_every_kind(i):
    """A small and a large tensor, a small and a large array, a bfloat16 tensor (numpy has no
    bfloat16): each crosses a process boundary by its own route."""
    import numpy as np
    import torch

    return {
        "small_t": torch.full((3,), int(i), dtype=torch.int32),
        "large_t": torch.full((300_000,), float(i)),  # 1.2 MB: shared memory
        "small_a": np.full((2, 2), float(i), dtype=np.float16),
        "large_a": np.full((300_000,), int(i), dtype=np.int64),
        "bf16": torch.full((2,), float(i), dtype=torch.bfloat16),
        "scalar": torch.tensor(int(i)),
    }
