"""The one table docs/MULTIWORKER.md shows: the multi-process fault matrix (tests/faults/matrix.py)
and the one-process one (tests/faults/fault_matrix.py), a row per case with what it expects, its
bound, the time measured, the outcome and what the user was told, under a totals line.

tests/faults/test_matrix.py writes it after a run of every case (the matrix tier, `bash
scripts/test.sh --matrix`); `python tests/faults/fault_matrix.py --write-doc` rewrites the
one-process rows alone, keeping the multi-process rows of the last full run.
"""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "MULTIWORKER.md"
START = "<!-- fault matrix: start (tests/faults/test_matrix.py writes this table after a run of every case) -->"
END = "<!-- fault matrix: end -->"
HEADER = "| case | expected | bound | measured | outcome | what the user was told |\n|---|---|---|---|---|---|"
MP_STAMP = "multi-process rows: "
OP_STAMP = "one-process rows: "

GOOD = {"ok", "clear error"}
SILENT = {"silent wrong", "data lost"}
LEFTOVER = {"leftover", "leak"}


@dataclass(frozen=True)
class Cells:
    case: str
    expected: str
    bound: str
    measured: str
    outcome: str
    message: str

    def line(self) -> str:
        cells = [self.case, self.expected, self.bound, self.measured, self.outcome, self.message]
        return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|") or "-"


def machine() -> str:
    return f"{datetime.date.today().isoformat()}, {platform.machine()} with {os.cpu_count()} cores"


def one_process_cells(row: object) -> Cells:
    """A row of tests/faults/fault_matrix.py."""
    r = row
    message = r.detail[:160]  # type: ignore[attr-defined]
    return Cells(r.case, r.expect, f"{r.bound:g} s", f"{r.seconds:.2f} s", r.outcome, f"`{message}`" if message else "")  # type: ignore[attr-defined]  # fmt: skip


def totals(rows: list[Cells], n_mp: int) -> str:
    bad = [c for c in rows if c.outcome not in GOOD]
    hangs = sum(c.outcome == "hang" for c in bad)
    silent = sum(c.outcome in SILENT for c in bad)
    left = sum(c.outcome in LEFTOVER for c in bad)
    other = [c for c in bad if c.outcome not in SILENT | LEFTOVER | {"hang"}]
    text = (
        f"**{len(rows)} cases** ({n_mp} multi-process, {len(rows) - n_mp} one-process): "
        f"{len(rows) - len(bad)} as expected; {hangs} hangs, {silent} silent results, {left} leftover processes"
    )
    if other:
        kinds = sorted({c.outcome for c in other})
        text += f", {len(other)} other ({', '.join(f'{sum(c.outcome == k for c in other)} {k}' for k in kinds)})"
    return text


def render(mp_stamp: str, mp: list[Cells], op_stamp: str, op: list[Cells]) -> str:
    rows = mp + op
    return "\n".join([
        totals(rows, len(mp)) + "  ",
        MP_STAMP + mp_stamp + "  ",
        OP_STAMP + op_stamp,
        "",
        HEADER,
        *(c.line() for c in rows),
    ])  # fmt: skip


def read(doc: Path = DOC) -> tuple[str, list[Cells], list[Cells]]:
    """The section as written: the multi-process rows' stamp, their rows and the one-process
    rows (a section in the table's first form, five columns of multi-process rows, is read too)."""
    from matrix import CASES, expected  # the multi-process cases, for the older form's rows

    body = doc.read_text().split(START, 1)[1].split(END, 1)[0]
    lines = [ln for ln in body.strip().splitlines()]
    mp_stamp = ""
    mp: list[Cells] = []
    op: list[Cells] = []
    by_name = {c.name: c for c in CASES}
    for ln in lines:
        if ln.startswith(MP_STAMP):
            mp_stamp = ln[len(MP_STAMP) :].rstrip()
        elif " cases ok; " in ln and not ln.startswith("|"):  # the first form's stamp
            mp_stamp = ln.split(" cases ok; ", 1)[1].strip()
        if not ln.startswith("| ") or ln.startswith(("| case |", "|---")):
            continue
        cells = [c.strip() for c in ln.strip()[2:-2].split(" | ")]
        if len(cells) == 5:  # case, bound, times, said, outcome
            case = by_name.get(cells[0])
            mp.append(
                Cells(
                    cells[0],
                    expected(case) if case else "-",
                    cells[1],
                    cells[2],
                    cells[4],
                    cells[3],
                )
            )
        elif len(cells) == 6:
            (mp if cells[0] in by_name else op).append(Cells(*cells))
        else:
            raise ValueError(f"{doc}: a row of the fault matrix of {len(cells)} cells: {ln[:200]}")
    return mp_stamp, mp, op


def write(body: str, doc: Path = DOC) -> None:
    text = doc.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{body}\n{END}{tail}")
