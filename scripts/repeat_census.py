"""The repeat census (issue 35): every multi-process test of the main tier, N times in a row.

One pytest run per test file (`--count N` from pytest-repeat, every failure kept, no `-x`), so a
census can stop and go on later: a file already in the summary is skipped. Each file's run writes
one line to SUMMARY (file, passed, failed, seconds, load, failing test ids) and its whole output
beside it. Run it from a clone whose `.venv` is made (`source scripts/_venv.sh`):

    python scripts/repeat_census.py --count 20 --out /tmp/census20 [FILE ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

MARK = "multiprocess and not slow and not matrix"


def files_with_multiprocess_tests() -> list[str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--collect-only",
            "-p",
            "no:cacheprovider",
            "-m",
            MARK,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counts = collections.Counter(line.split("::")[0] for line in out.splitlines() if "::" in line)
    return sorted(counts)


def done_files(summary: Path) -> set[str]:
    if not summary.exists():
        return set()
    return {line.split("\t")[0] for line in summary.read_text().splitlines() if line.strip()}


def failures(junit: Path) -> list[str]:
    if not junit.exists():
        return ["<no junit report: pytest did not finish>"]
    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            found.append(case.get("name", "?"))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--timeout", type=float, default=3 * 3600, help="seconds for one file's run"
    )
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = args.out / "SUMMARY.tsv"
    todo = [
        f for f in (args.files or files_with_multiprocess_tests()) if f not in done_files(summary)
    ]
    print(f"{len(todo)} files to run, {args.count} times each", flush=True)
    for path in todo:
        name = re.sub(r"[^A-Za-z0-9]+", "_", path)
        junit = args.out / f"{name}.xml"
        log = args.out / f"{name}.log"
        start = time.monotonic()
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            MARK,
            "--count",
            str(args.count),
            f"--junitxml={junit}",
            path,
        ]
        with log.open("w") as sink:
            try:
                subprocess.run(
                    cmd,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    timeout=args.timeout,
                    env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                )
            except subprocess.TimeoutExpired:
                sink.write(f"\nrepeat_census: the run passed {args.timeout} s and was stopped\n")
        seconds = time.monotonic() - start
        failed = failures(junit)
        passed = 0
        if junit.exists():
            cases = list(ET.parse(junit).getroot().iter("testcase"))
            passed = sum(1 for c in cases if not len(c))  # no failure, error or skipped child
        load = os.getloadavg()[0]
        line = f"{path}\t{passed}\t{len(failed)}\t{seconds:.0f}\t{load:.1f}\t{';'.join(failed)}"
        with summary.open("a") as sink:
            sink.write(line + "\n")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
