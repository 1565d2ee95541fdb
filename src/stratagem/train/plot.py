"""plot_history: one panel per log (loss, then metrics), training and validation curves, as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _figure_class() -> Any:
    """matplotlib's Figure (no pyplot: the user's backend and global state are left alone)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "History.plot needs matplotlib, which is not installed; install it with "
            "`pip install matplotlib` (or `pip install stratagem[plot]`)"
        ) from e
    return Figure


def panels(history: dict[str, list[float]]) -> list[tuple[str, str | None]]:
    """(training key, validation key or None) per panel: loss first, then the metrics in order."""
    train = [k for k in history if not k.startswith("val_")]
    train.sort(key=lambda k: k != "loss")
    out = [(k, f"val_{k}" if f"val_{k}" in history else None) for k in train]
    orphans = [k for k in history if k.startswith("val_") and k[4:] not in history]
    return out + [(k, None) for k in orphans]


def plot_history(
    history: dict[str, list[float]], epochs: list[int], path: Path, *, title: str | None = None
) -> Path:
    if not history:
        raise ValueError("this History has no logs to plot; run fit for at least one epoch first")
    cols = panels(history)
    from matplotlib.ticker import MaxNLocator

    fig = _figure_class()(figsize=(4.5 * len(cols), 3.6))
    axes = fig.subplots(1, len(cols), squeeze=False)
    xs = [e + 1 for e in epochs]
    for ax, (key, val) in zip(axes[0], cols):
        ax.plot(xs, history[key], marker="o", label="training" if not key.startswith("val_") else key)
        if val is not None:
            ax.plot(xs, history[val], marker="o", label="validation")
        ax.set_title(key)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
