"""Reusable contract: an iterator resumes exactly from any step, in-process or in a fresh process."""

from __future__ import annotations

import base64
import itertools
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from stratagem.data.dataset import Dataset


def to_plain(element: Any) -> Any:
    """An element as JSON values (tensors and arrays tagged with dtype and shape)."""
    if isinstance(element, torch.Tensor):
        return {"tensor": str(element.dtype), "shape": list(element.shape),
                "values": element.reshape(-1).tolist()}
    if isinstance(element, np.ndarray):
        return {"ndarray": str(element.dtype), "shape": list(element.shape),
                "values": element.reshape(-1).tolist()}
    if isinstance(element, np.generic):
        return {"scalar": str(element.dtype), "value": element.item()}
    if isinstance(element, tuple):
        return {"tuple": [to_plain(e) for e in element]}
    if isinstance(element, dict):
        return {"dict": {str(k): to_plain(v) for k, v in sorted(element.items())}}
    if isinstance(element, bytes):
        return {"bytes": element.hex()}
    return element


_CHILD = r"""
import base64, json, pickle, sys
from stratagem.data.testing import to_plain
make = pickle.loads(base64.b64decode(sys.argv[1]))
state = json.loads(sys.stdin.read())
it = make().iterator_from_state(state)
rest = [to_plain(e) for e in it]
it.close()
sys.stdout.write(json.dumps(rest))
"""


def _rest_in_fresh_process(make_dataset: Callable[[], Dataset], state: dict, timeout: float) -> list:
    try:
        blob = base64.b64encode(pickle.dumps(make_dataset)).decode()
    except Exception as e:
        raise TypeError(
            "assert_resumes_exactly(fresh_process=True) needs a picklable make_dataset "
            f"(a module-level function): {e}"
        ) from e
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, blob], input=json.dumps(state), capture_output=True,
        text=True, timeout=timeout, env=env,
    )
    if proc.returncode != 0:
        raise AssertionError(f"the fresh process failed to resume:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def assert_resumes_exactly(
    make_dataset: Callable[[], Dataset],
    ks: Sequence[int],
    fresh_process: bool = False,
    *,
    seed: int = 1234,
    epoch: int = 0,
    timeout: float = 120.0,
    ordered: bool = True,
) -> list[Any]:
    """Take k elements, save the state (through JSON), restore in a new iterator (or a fresh
    Python process), and check that the rest equals an uninterrupted run element for element.
    ``ordered=False`` (a pipeline with ``deterministic=False``): the elements taken before the
    save and after the restore are the uninterrupted run's, each once, in any order.

    Returns the uninterrupted run (as :func:`to_plain` values).
    """
    with make_dataset().iterator(epoch=epoch, seed=seed) as it:
        reference = [to_plain(e) for e in it]
    for k in ks:
        with make_dataset().iterator(epoch=epoch, seed=seed) as it:
            head = [to_plain(e) for e in itertools.islice(it, k)]
            state = json.loads(json.dumps(it.state_dict()))
        if fresh_process:
            rest = _rest_in_fresh_process(make_dataset, state, timeout)
        else:
            with make_dataset().iterator_from_state(state) as restored:
                rest = [to_plain(e) for e in restored]
        got = head + rest
        if not ordered:
            if sorted(got, key=repr) != sorted(reference, key=repr):
                missing = [e for e in reference if e not in got]
                extra = [e for e in got if e not in reference]
                raise AssertionError(
                    f"resume after {k} elements of an unordered pipeline lost {missing[:5]!r} and "
                    f"added {extra[:5]!r} (got {len(got)} elements, expected {len(reference)})"
                )
            continue
        if got != reference:
            n = next(
                (i for i, (a, b) in enumerate(zip(got, reference)) if a != b),
                min(len(got), len(reference)),
            )
            raise AssertionError(
                f"resume after {k} elements diverges at element {n}: got {len(got)} elements, "
                f"expected {len(reference)}; got[{n}]={got[n] if n < len(got) else None!r}, "
                f"expected {reference[n] if n < len(reference) else None!r}"
            )
    return reference
