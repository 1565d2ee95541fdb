"""What a run prints: a clean run says nothing on stderr that the user did not cause, and a
failing run says one clear thing per rank."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

#: a stderr line that means something went wrong, or that someone should act
PROBLEM = re.compile(r"Traceback|Exception ignored|Warning|Error")


def stderr_problems(stderr: str, allow: Sequence[tuple[str, str]] = ()) -> list[str]:
    """The lines of ``stderr`` that look like a traceback, a warning or an error, except those a
    pattern of ``allow`` matches: ``(regex, reason)`` pairs, each saying why the line is the user's
    own (a reason is required)."""
    for pattern, reason in allow:
        if not reason.strip():
            raise ValueError(f"allow-list entry {pattern!r} needs a reason")
    return [
        line for line in stderr.splitlines()
        if PROBLEM.search(line) and not any(re.search(p, line) for p, _ in allow)
    ]  # fmt: skip


def assert_clean_run(result: Any, allow: Sequence[tuple[str, str]] = (), what: str = "the run") -> None:
    """``result`` (a ``WorkerResult`` or ``subprocess.CompletedProcess``) exited 0 and its stderr
    has no traceback, warning or error line but those ``allow`` explains."""
    code = result.returncode
    assert code == 0, f"{what} exited with {code}:\n{result.stderr[-3000:]}"
    problems = stderr_problems(result.stderr, allow)
    assert not problems, f"{what} printed on stderr:\n" + "\n".join(problems) + f"\n--- stderr:\n{result.stderr[-3000:]}"


def stratagem_lines(stderr: str) -> list[str]:
    """The lines stratagem printed about a failure (``stratagem: ...``, ``stratagem run: ...``)."""
    return [line for line in stderr.splitlines() if line.startswith("stratagem")]


def tracebacks(stderr: str) -> int:
    """How many tracebacks ``stderr`` holds."""
    return sum(1 for line in stderr.splitlines() if line.startswith("Traceback (most recent call last)"))
