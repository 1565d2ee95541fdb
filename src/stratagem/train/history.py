"""History: the per-epoch logs of a fit run (``history.history`` as in Keras) and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def log_value(value: Any) -> Any:
    """One log's value: a float, or a float64 array for a metric with one value per class
    (Keras's ``F1Score(average=None)``, ``Precision(thresholds=[...])``), as Keras logs them."""
    if isinstance(value, (int, float)):
        return float(value)
    array = np.asarray(value.detach().cpu() if hasattr(value, "detach") else value, dtype=np.float64)
    return float(array.reshape(-1)[0]) if array.size == 1 else array


class History:
    """What ``fit`` returns: ``history[name]`` is the list of a log's per-epoch values.

    ``history.history`` is the dict (``{"loss": [...], "val_loss": [...], ...}``),
    ``history.epoch`` the epoch numbers (0-based) and ``history.params`` fit's parameters.
    """

    def __init__(self, params: dict[str, Any] | None = None) -> None:
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []
        self.params: dict[str, Any] = dict(params or {})

    def record(self, epoch: int, logs: dict[str, float]) -> None:
        """Append one epoch's logs (a key missing in earlier epochs is padded with nan)."""
        for key in logs:
            if key not in self.history:
                self.history[key] = [float("nan")] * len(self.epoch)
        self.epoch.append(int(epoch))
        for key, values in self.history.items():
            values.append(log_value(logs.get(key, float("nan"))))

    def update_last(self, logs: dict[str, float]) -> None:
        """Merge ``logs`` into the last epoch's entry (logs a callback added at epoch end)."""
        if not self.epoch:
            raise ValueError("this History has no epoch to update")
        n = len(self.epoch)
        for key, value in logs.items():
            values = self.history.setdefault(key, [float("nan")] * n)
            values[-1] = log_value(value)

    def state_dict(self) -> dict[str, Any]:
        plain = {k: [x.tolist() if isinstance(x, np.ndarray) else x for x in v] for k, v in self.history.items()}
        return {"history": plain, "epoch": list(self.epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {str(k): [log_value(x) for x in v] for k, v in state["history"].items()}
        self.epoch = [int(e) for e in state["epoch"]]

    def __getitem__(self, key: str) -> list[float]:
        return self.history[key]

    def __repr__(self) -> str:
        keys = ", ".join(self.history)
        return f"History(epochs={len(self.epoch)}, logs=[{keys}])"

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Write a PNG of loss and each metric per epoch, training and validation; return its path.

        Needs matplotlib (``pip install matplotlib``). Call it on one replica (e.g. the chief).
        """
        from stratagem.train.plot import plot_history

        return plot_history(self.history, self.epoch, Path(path), title=title)
