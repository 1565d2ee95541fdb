"""FitProgress: what fit saves beyond model, optimizer and RNG so a run resumes exactly.

It records, as JSON: epoch and step, the optimizer step count, the data position
(GlobalBatches.state_dict, including a stratagem Dataset iterator's state), this replica's totals
of the epoch's loss and metrics, the History so far, and the fp16 loss scaler's state. It is a per-replica object for
``Checkpoint`` (each replica saves and restores its own), so restored metric totals sum across
replicas exactly as they did before the interruption.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from stratagem.train.inputs import GlobalBatches
from stratagem.train.metrics import Metric

FORMAT = "stratagem.train.fit_progress/1"


class FitProgress:
    """Epoch, step, data position, metric totals and history of a fit run (checkpointable)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def capture(
        self,
        *,
        epoch: int,
        step: int,
        iterations: int,
        data: dict[str, Any],
        metrics: Sequence[Metric],
        history: dict[str, Any],
        loss_scale: dict[str, Any] | None = None,
    ) -> None:
        self.state = {
            "format": FORMAT,
            "epoch": int(epoch),
            "step": int(step),
            "iterations": int(iterations),
            "data": data,
            "metrics": [[m.name, m.local_totals().tolist()] for m in metrics],
            "history": history,
            "loss_scale": loss_scale,
        }

    def restore_metrics(self, metrics: Sequence[Metric]) -> None:
        saved = self.state["metrics"]
        names = [m.name for m in metrics]
        if names != [n for n, _ in saved]:
            raise ValueError(
                f"the backup was made with metrics {[n for n, _ in saved]} but this run has "
                f"{names}; resume with the same metrics (or start over in a new backup directory)"
            )
        for m, (_, totals) in zip(metrics, saved):
            m.load_totals(torch.tensor(totals, dtype=torch.float64))

    # --- as a checkpointable object ----------------------------------------------------------
    @staticmethod
    def reshard_state(states: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
        """Replica ``rank`` of ``world``'s progress from the records of another number of
        replicas (``Checkpoint`` asks for it when a backup is restored into another job size):
        epoch, step and history are every replica's; the data position is replayed
        (``GlobalBatches.reshard_state``); the epoch's metric totals are summed into replica 0
        (the others start at zero), so the global totals, and the logs, are what they were."""
        records = [_record(s) for s in states]
        first = records[0]
        for key in ("epoch", "step", "iterations", "history"):
            if any(r[key] != first[key] for r in records):
                raise ValueError(
                    f"the backup's replicas disagree on {key!r} ({[r[key] for r in records]}); it was "
                    "not written by one fit run: start over in a new backup directory"
                )
        names = [n for n, _ in first["metrics"]]
        summed = [[float(sum(col)) for col in zip(*(r["metrics"][i][1] for r in records))] for i in range(len(names))]
        record = dict(first)
        record["data"] = GlobalBatches.reshard_state([r["data"] for r in records], world)
        record["metrics"] = [[n, t if rank == 0 else [0.0] * len(t)] for n, t in zip(names, summed)]
        return {"json": json.dumps(record)}

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(self.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = _record(state)


def _record(state: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(state["json"])
    if loaded.get("format") != FORMAT:
        raise ValueError(
            f"not a stratagem fit progress record (format {loaded.get('format')!r}, expected "
            f"{FORMAT!r}); was this directory written by BackupAndRestore?"
        )
    return loaded
