"""Benchmark: ``map(num_parallel_calls=AUTOTUNE)`` against the sequential ``map``, as ratios.

AUTOTUNE must never make a pipeline slower than its sequential form (issue 30: it was 2.7x
slower in the tf.data performance guide's own benchmark, with an engine probe of about 0.8 s
in the first epoch). The guide's code is ported as written ("Better performance with the
tf.data API": ``ArtificialDataset``, ``benchmark``, ``mapped_function``, the vectorizing
section's ``fast_dataset`` / ``increment``; ``tf.py_function(lambda: time.sleep(0.03))``
becomes ``time.sleep(0.03)``), with the guide's sleeps. Added: a CPU-bound map holding the GIL
(pure Python, where only processes scale), one releasing it (hashlib), and a cheap one.

Each row prints the median seconds of the sequential and the AUTOTUNE pipeline (a fresh
dataset each round, as the guide builds them; the variants alternate round by round so they
see the same load), the ratio AUTOTUNE / sequential (below 1: AUTOTUNE is faster), and the
first round alone (the first epoch, where a probe would show).

Run: ``.venv/bin/python benchmarks/autotune_vs_sequential.py [--rounds 5]`` (about a minute).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable

import torch

import stratagem.data as sgd
from stratagem.data import AUTOTUNE


class ArtificialDataset:
    """The guide's dataset: a file that takes 30 ms to open and 15 ms per sample to read."""

    @staticmethod
    def _generator(num_samples):
        # Opening the file
        time.sleep(0.03)

        for sample_idx in range(num_samples):
            # Reading data (line, record) from the file
            time.sleep(0.015)

            yield (sample_idx,)

    def __new__(cls, num_samples=3):
        return sgd.Dataset.from_generator(
            cls._generator,
            output_signature=sgd.TensorSpec(shape=(1,), dtype=torch.int64),
            args=(num_samples,),
        )


def benchmark(dataset, num_epochs=2):
    start_time = time.perf_counter()
    for _epoch_num in range(num_epochs):
        for _sample in dataset:
            # Performing a training step
            time.sleep(0.01)
    return time.perf_counter() - start_time


def mapped_function(s):
    # Do some hard pre-processing
    time.sleep(0.03)  # tf: tf.py_function(lambda: time.sleep(0.03), [], ())
    return s


def fast_benchmark(dataset, num_epochs=2):
    start_time = time.perf_counter()
    for _ in range(num_epochs):
        for _ in dataset:
            pass
    return time.perf_counter() - start_time


def increment(x):
    return x + 1


def python_work(x):
    """Pure Python (holds the GIL): threads cannot scale it, processes can."""
    total = 0
    for i in range(40_000):
        total = (total * 31 + i) % 1_000_003
    return x + total


_BUF = bytes(1 << 20)


def hash_work(x):
    """hashlib over 1 MiB (releases the GIL): threads scale it."""
    hashlib.sha256(_BUF).digest()
    return x


def cpu_benchmark(dataset):
    return fast_benchmark(dataset, num_epochs=2)


# name -> (sequential pipeline, AUTOTUNE pipeline, timing function)
Pipelines = dict[str, tuple[Callable[[], sgd.Dataset], Callable[[], sgd.Dataset],
                            Callable[[sgd.Dataset], float]]]
PIPELINES: Pipelines = {
    "guide: map (sleep 30 ms)": (
        lambda: ArtificialDataset().map(mapped_function),
        lambda: ArtificialDataset().map(mapped_function, num_parallel_calls=AUTOTUNE),
        benchmark,
    ),
    "guide: map + prefetch": (
        lambda: ArtificialDataset().map(mapped_function).prefetch(AUTOTUNE),
        lambda: ArtificialDataset().map(mapped_function, num_parallel_calls=AUTOTUNE)
        .prefetch(AUTOTUNE),
        benchmark,
    ),
    "guide: scalar map (increment)": (
        lambda: sgd.Dataset.range(10000).map(increment).batch(256),
        lambda: sgd.Dataset.range(10000).map(increment, num_parallel_calls=AUTOTUNE).batch(256),
        fast_benchmark,
    ),
    "guide: vectorized map": (
        lambda: sgd.Dataset.range(10000).batch(256).map(increment),
        lambda: sgd.Dataset.range(10000).batch(256).map(increment, num_parallel_calls=AUTOTUNE),
        fast_benchmark,
    ),
    "CPU-bound, holds the GIL": (
        lambda: sgd.Dataset.range(120).map(python_work),
        lambda: sgd.Dataset.range(120).map(python_work, num_parallel_calls=AUTOTUNE),
        cpu_benchmark,
    ),
    "CPU-bound, releases the GIL": (
        lambda: sgd.Dataset.range(120).map(hash_work),
        lambda: sgd.Dataset.range(120).map(hash_work, num_parallel_calls=AUTOTUNE),
        cpu_benchmark,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="run the pipelines whose name contains this")
    args = parser.parse_args()
    print(f"{'pipeline':<32} {'sequential s':>12} {'AUTOTUNE s':>11} {'ratio':>6} "
          f"{'1st round ratio':>15}")
    for name, (sequential, autotuned, timer) in PIPELINES.items():
        if args.only not in name:
            continue
        times: dict[str, list[float]] = {"seq": [], "auto": []}
        for r in range(args.rounds):
            order = [("seq", sequential), ("auto", autotuned)]
            for key, make in (order if r % 2 == 0 else order[::-1]):
                times[key].append(timer(make()))
        seq, auto = statistics.median(times["seq"]), statistics.median(times["auto"])
        first = times["auto"][0] / times["seq"][0]
        print(f"{name:<32} {seq:>12.3f} {auto:>11.3f} {auto / seq:>6.2f} {first:>15.2f}",
              flush=True)


if __name__ == "__main__":
    main()
