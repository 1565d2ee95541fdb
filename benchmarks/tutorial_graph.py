"""TensorFlow's custom-training tutorial in graph mode against the same program eager, in one run.

``examples/tutorials/custom_training.py`` is the tutorial as written, eager; TensorFlow's own
puts ``@tf.function`` on ``distributed_train_step``, ``distributed_test_step`` and
``distributed_train_epoch``. This script runs the program eagerly, with ``@sg.function`` in those
three places ("graph": compiled once compiling pays, the default), and with
``@sg.function(jit_compile=True)`` ("jit": compiled at the first call), alternating, ``--rounds``
times each, 2 replicas, and prints the wall time of each whole run (start-up and compilation
included: what the user waits for), their ratio, and whether anything was printed on stderr. jit
is timed twice: with a cold compile cache (a new ``TORCHINDUCTOR_CACHE_DIR`` per run: a program's
first run on a machine) and a warm one (the cache of an earlier run, unmeasured: every later run
of the same program).

Run: ``python benchmarks/tutorial_graph.py [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[1] / "examples" / "tutorials" / "custom_training.py"
GRAPH = ("distributed_train_step", "distributed_test_step", "distributed_train_epoch")


def graph_variant(folder: Path, decorator: str = "@sg.function") -> Path:
    text = TUTORIAL.read_text()
    for name in GRAPH:
        text = text.replace(f"\ndef {name}(", f"\n{decorator}\ndef {name}(")
    path = folder / f"custom_training_graph{'_jit' if 'jit_compile' in decorator else ''}.py"
    path.write_text(text)
    return path


def timed(script: Path, folder: Path, cache: Path | None = None) -> tuple[float, str]:
    stamp = time.monotonic_ns()
    env = {**os.environ, "CHECKPOINT_DIR": str(folder / f"ckpt-{stamp}"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache or folder / f"cold-{stamp}")}  # fmt: skip
    start = time.perf_counter()
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    took = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{script.name} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return took, r.stderr


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        graph = graph_variant(folder)
        jit = graph_variant(folder, "@sg.function(jit_compile=True)")
        warm = folder / "warm-cache"
        timed(jit, folder, warm)  # fills the warm cache
        times: dict[str, list[float]] = {"eager": [], "graph": [], "jit, cold cache": [], "jit, warm cache": []}
        stderr: dict[str, str] = dict.fromkeys(times, "")
        for r in range(args.rounds):
            order = [("eager", TUTORIAL, warm), ("graph", graph, warm), ("jit, cold cache", jit, None),
                     ("jit, warm cache", jit, warm)]  # fmt: skip
            for name, script, cache in order if r % 2 == 0 else reversed(order):
                took, err = timed(script, folder, cache)
                times[name].append(took)
                stderr[name] += err
    med = {name: statistics.median(v) for name, v in times.items()}
    print("TensorFlow's custom-training tutorial, 2 replicas, whole program (start-up and compilation included)")
    for name, v in times.items():
        clean = "clean stderr" if not stderr[name].strip() else f"stderr: {stderr[name].strip().splitlines()[0][:120]}"
        print(f"{name:17s} {med[name]:6.1f} s  (runs: {', '.join(f'{t:.1f}' for t in v)}; {clean})")
    for name in ("graph", "jit, cold cache", "jit, warm cache"):
        print(f"{name} / eager speed: {med['eager'] / med[name]:.2f}x")


if __name__ == "__main__":
    main()
