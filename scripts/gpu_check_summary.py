"""The summary of ``scripts/gpu_check.sh``: one table from the steps' results and their logs.

The shell script runs each step under ``timeout`` and appends one tab-separated line per step to
a steps file: ``name<TAB>status<TAB>exit code<TAB>seconds<TAB>log path`` (status: ``passed``,
``failed``, ``timeout`` or ``skipped``; a skipped step's log holds the reason). Benchmarks print
``RESULT <key>=<float>`` lines; every such line in a step's log becomes a figure, compared with
its target below when it has one. The table (markdown) is printed and written to ``--out``.

Run: ``python scripts/gpu_check_summary.py STEPS_FILE --out gpu_check.md [--machine TEXT]``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

# key -> (what it measures, lowest acceptable value): the targets of issue 21
TARGETS: dict[str, tuple[str, float | None]] = {
    "fit_vs_plain": ("fit / plain loop, ResNet-18 112px bf16 channels_last b256", 0.97),
    "onedevice_vs_plain": ("OneDeviceStrategy.run / plain torch, same step", 0.98),
    "feed_vs_dataloader": ("image feed / DataLoader(8, pin_memory), training images/s", 1.0),
    "feed_vs_gpu_bound": ("image feed / batches already on the GPU", 0.9),
    "sharded_vs_fully_shard": ("ShardedStrategy / hand-written fully_shard", 0.95),
    "mirrored_vs_ddp": ("MirroredStrategy / DDP", 1.0),
}
RESULT = re.compile(r"^RESULT\s+([A-Za-z0-9_.-]+)=([-+0-9.eE]+|nan|inf)\s*$")
STATUSES = ("passed", "failed", "timeout", "skipped")


@dataclass
class Step:
    name: str
    status: str
    rc: int
    seconds: float
    log: str
    figures: dict[str, float] = field(default_factory=dict)
    note: str = ""


def parse_results(text: str) -> dict[str, float]:
    """Every ``RESULT key=value`` line of a log (the last one wins for a repeated key)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = RESULT.match(line.strip())
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:160] if lines else ""


def read_steps(path: Path) -> list[Step]:
    steps = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 5 or parts[1] not in STATUSES:
            raise ValueError(f"{path}:{n}: expected 'name<TAB>status<TAB>rc<TAB>seconds<TAB>log' "
                             f"with status in {STATUSES}, got {line!r}")
        name, status, rc, secs, log = parts
        text = Path(log).read_text(errors="replace") if log and Path(log).is_file() else ""
        step = Step(name, status, int(rc), float(secs), log, parse_results(text))
        if status != "passed":
            step.note = last_line(text)
        steps.append(step)
    return steps


def verdict(key: str, value: float) -> str:
    target = TARGETS.get(key, ("", None))[1]
    if target is None:
        return ""
    return "met" if value >= target else "NOT met"


def render(steps: list[Step], machine: str) -> str:
    lines = ["# stratagem GPU check", "", f"Machine: {machine}", "",
             "| step | result | seconds | note |", "|---|---|---|---|"]
    for s in steps:
        shown = s.status if s.status in ("passed", "skipped") else f"**{s.status.upper()}** (exit {s.rc})"
        note = s.note.replace("|", "\\|")
        lines.append(f"| {s.name} | {shown} | {s.seconds:.0f} | {note} |")
    lines += ["", "| figure | value | target | verdict | step |", "|---|---|---|---|---|"]
    any_figure = False
    for s in steps:
        for key, value in s.figures.items():
            any_figure = True
            what, target = TARGETS.get(key, (key, None))
            tgt = f">= {target:g}" if target is not None else ""
            lines.append(f"| {what} (`{key}`) | {value:.3f} | {tgt} | {verdict(key, value)} | {s.name} |")
    for key, (what, target) in TARGETS.items():
        if not any(key in s.figures for s in steps):
            any_figure = True
            lines.append(f"| {what} (`{key}`) | not measured | >= {target:g} | | |")
    if not any_figure:
        lines.append("| (none) | | | | |")
    bad = [s.name for s in steps if s.status in ("failed", "timeout")]
    lines += ["", f"Steps: {sum(s.status == 'passed' for s in steps)} passed, {len(bad)} failed, "
              f"{sum(s.status == 'skipped' for s in steps)} skipped" + (f" (failed: {', '.join(bad)})" if bad else "")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("steps", type=Path, help="the steps file gpu_check.sh writes")
    p.add_argument("--out", type=Path, required=True, help="where to write the markdown table")
    p.add_argument("--machine", default="unknown", help="GPU name, torch version, cores")
    args = p.parse_args(argv)
    table = render(read_steps(args.steps), args.machine)
    args.out.write_text(table)
    sys.stdout.write(table)
    sys.stdout.write(f"(written to {args.out})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
