"""Progress: fit's console output, a live bar on a terminal or one line per epoch, on replica 0.

``verbose`` (fit's argument, as in Keras): 0 silent; 1 a live progress bar (step count, ETA,
loss and metrics, samples/s), redrawn in place at most every 0.1 s, finished with the epoch's
line; 2 one line per epoch; ``"auto"`` the bar when the output is a terminal and lines
otherwise (logs, CI). Only replica 0 prints unless ``all_replicas=True`` (each line then names
its replica). Values shown are global (summed over replicas), identical everywhere.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from stratagem.train.callback import Callback, Logs


def resolve_mode(verbose: int | str, stream: IO[str] | None = None) -> str | None:
    """``"bar"``, ``"line"`` or None (silent) for fit's ``verbose`` argument."""
    if verbose == "auto":
        out = stream if stream is not None else sys.stdout
        isatty = getattr(out, "isatty", None)
        return "bar" if callable(isatty) and isatty() else "line"
    if verbose in (0, False):
        return None
    if verbose in (1, True):
        return "bar"
    if verbose == 2:
        return "line"
    raise ValueError(f"verbose must be 'auto', 0, 1 or 2 (as in Keras); got {verbose!r}")


def _fmt_value(v: Any) -> str:
    if not isinstance(v, (int, float)):  # one value per class
        return "[" + ", ".join(_fmt_value(float(x)) for x in v) + "]"
    return f"{v:.4f}" if abs(v) >= 1e-3 or v == 0 else f"{v:.4e}"


def _fmt_time(seconds: float) -> str:
    if seconds >= 3600:
        return f"{int(seconds // 3600)}:{int(seconds % 3600 // 60):02d}:{int(seconds % 60):02d}"
    if seconds >= 60:
        return f"{int(seconds // 60)}:{int(seconds % 60):02d}"
    return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"


def format_logs(logs: Logs) -> str:
    return " - ".join(f"{k}: {_fmt_value(v)}" for k, v in logs.items())


def render_bar(step: int, total: int | None, width: int = 24) -> str:
    """``" 12/50 [=====>..................]"`` (or ``" 12/?"`` when the total is unknown)."""
    if total is None or total <= 0:
        return f"{step}/?"
    filled = min(width, int(width * step / total))
    arrow = ">" if filled < width else ""
    bar = "=" * filled + arrow + "." * (width - filled - len(arrow))
    digits = len(str(total))
    return f"{step:>{digits}}/{total} [{bar}]"


class Progress(Callback):
    """Prints training progress (see the module docstring); fit adds one from ``verbose``."""

    def __init__(self, mode: str = "line", *, all_replicas: bool = False, stream: IO[str] | None = None, interval: float = 0.1) -> None:
        super().__init__()
        if mode not in ("bar", "line"):
            raise ValueError(f"Progress mode must be 'bar' or 'line'; got {mode!r}")
        self.mode = mode
        self.all_replicas = all_replicas
        self.stream = stream
        self.interval = interval
        self._epoch_start = 0.0
        self._last_draw = 0.0
        self._start_samples = 0
        self._start_step = 0
        self._train_end = 0.0

    # --- output ----------------------------------------------------------------------------
    def _speaks(self) -> bool:
        return self.all_replicas or self.state.is_chief

    def _write(self, text: str) -> None:
        out = self.stream if self.stream is not None else sys.stdout
        if self.all_replicas and self.state.strategy.num_replicas_in_sync > 1:
            prefix = f"[replica {self.state.strategy.extended.replica_id}] "
            text = "\n".join(prefix + line if line and not line.startswith("\r") else line for line in text.split("\n"))
            text = text.replace("\r", "\r" + prefix)
        out.write(text)
        out.flush()

    def _live(self) -> bool:
        """Whether the bar can be redrawn in place (the output is a terminal)."""
        out = self.stream if self.stream is not None else sys.stdout
        isatty = getattr(out, "isatty", None)
        return bool(callable(isatty) and isatty())

    def _rate(self) -> str:
        elapsed = (self._train_end or time.monotonic()) - self._epoch_start
        seen = self.state.samples - self._start_samples
        return f"{seen / elapsed:.0f} samples/s" if elapsed > 0 and seen > 0 else ""

    # --- hooks -------------------------------------------------------------------------------
    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch_start = time.monotonic()
        self._last_draw = 0.0
        self._start_samples = self.state.samples
        self._start_step = self.state.step
        self._train_end = 0.0
        if self.mode == "bar" and self._speaks():
            self._write(f"Epoch {epoch + 1}/{self.params.get('epochs', '?')}\n")

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        now = self._train_end = time.monotonic()
        if self.mode != "bar" or not self._speaks() or not self._live():
            return
        total = self.params.get("steps")
        step = self.state.step
        if now - self._last_draw < self.interval and step != total:
            return
        self._last_draw = now
        parts = [render_bar(step, total)]
        done = step - self._start_step
        if total and done > 0 and step < total:
            parts.append(f"ETA: {_fmt_time((now - self._epoch_start) / done * (total - step))}")
        if logs:
            parts.append(format_logs(logs))
        rate = self._rate()
        if rate:
            parts.append(rate)
        self._write("\r" + " - ".join(parts) + "\033[K")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self._speaks():
            return
        elapsed = _fmt_time(time.monotonic() - self._epoch_start)
        parts = [elapsed]
        if logs:
            parts.append(format_logs(logs))
        rate = self._rate()
        if rate:
            parts.append(rate)
        if self.mode == "bar" and self._live():
            head = render_bar(self.state.step, self.params.get("steps") or self.state.step)
            self._write("\r" + " - ".join([head, *parts]) + "\033[K\n")
        elif self.mode == "bar":
            head = render_bar(self.state.step, self.params.get("steps") or self.state.step)
            self._write(" - ".join([head, *parts]) + "\n")
        else:
            self._write(f"Epoch {epoch + 1}/{self.params.get('epochs', '?')} - " + " - ".join(parts) + "\n")
