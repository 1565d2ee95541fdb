"""What fit saves beyond model and optimizer so an interrupted run resumes exactly.

``FitProgress`` holds, as JSON-serializable values: epoch and step, the data position
(GlobalBatches.state_dict, with the stratagem Dataset iterator's state), the global totals of the
epoch's loss and metrics, the History so far, and every replica's random number generator states
(torch CPU and CUDA, numpy, Python ``random``), gathered by replica. ``capture`` is collective
(every replica calls it); ``restore`` is local: replica r takes back its own RNG state, and its
metrics get the global totals on replica 0 and zeros elsewhere, so their sum is unchanged.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stratagem.distribute.strategy import Strategy
from stratagem.train.metrics import Metric

FORMAT = "stratagem.train.fit_progress/1"


def rng_state() -> dict[str, Any]:
    """This process's generator states as plain values."""
    np_state: Any = np.random.get_state()
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def gather_json(strategy: Strategy, value: Any) -> list[Any]:
    """Every replica's JSON-serializable ``value``, in replica order (collective)."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    if strategy.num_replicas_in_sync == 1:
        return [value]
    sizes = strategy.gather(torch.tensor([data.numel()], dtype=torch.int64), axis=0).tolist()
    blob = strategy.gather(data, axis=0).cpu().numpy().tobytes()
    out, offset = [], 0
    for n in sizes:
        out.append(json.loads(blob[offset : offset + n].decode()))
        offset += n
    return out


class FitProgress:
    """Epoch, step, data position, metric totals, history and RNG states of a fit run."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def capture(
        self,
        strategy: Strategy,
        *,
        epoch: int,
        step: int,
        iterations: int,
        data: dict[str, Any],
        metrics: Sequence[Metric],
        history: dict[str, Any],
    ) -> dict[str, Any]:
        totals = torch.cat([m.local_totals() for m in metrics]) if metrics else torch.zeros(0, dtype=torch.float64)
        if strategy.num_replicas_in_sync > 1 and metrics:
            totals = strategy.reduce("sum", totals).to("cpu", torch.float64)
        self.state = {
            "format": FORMAT,
            "epoch": int(epoch),
            "step": int(step),
            "iterations": int(iterations),
            "data": data,
            "metrics": {m.name: m.local_totals().tolist() for m in metrics},
            "metric_order": [m.name for m in metrics],
            "global_totals": totals.tolist(),
            "history": history,
            "rng": gather_json(strategy, rng_state()),
            "num_replicas": strategy.num_replicas_in_sync,
        }
        return self.state

    def restore_metrics(self, strategy: Strategy, metrics: Sequence[Metric]) -> None:
        names = [m.name for m in metrics]
        if names != self.state["metric_order"]:
            raise ValueError(
                f"the backup was made with metrics {self.state['metric_order']} but this run has "
                f"{names}; resume with the same metrics (or start over in a new backup directory)"
            )
        totals = torch.tensor(self.state["global_totals"], dtype=torch.float64)
        first = strategy.extended.replica_id == 0
        offset = 0
        for m in metrics:
            part = totals[offset : offset + m.num_totals]
            m.load_totals(part if first else torch.zeros_like(part))
            offset += m.num_totals

    def restore_rng(self, strategy: Strategy) -> None:
        states = self.state["rng"]
        r = strategy.extended.replica_id
        set_rng_state(states[r] if r < len(states) else states[0])

    # --- as a checkpointable object ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(self.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raw = state["json"]
        loaded = json.loads(raw if isinstance(raw, str) else bytes(raw).decode())
        if loaded.get("format") != FORMAT:
            raise ValueError(f"not a stratagem fit progress record (format {loaded.get('format')!r})")
        self.state = loaded
