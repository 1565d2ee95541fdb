"""Warnings for the user (a real misuse): printed once per message, by one process of the job.

Every replica runs the same code and would print the same warning, N times over. The job's
first process (``RANK`` 0, or no ``RANK``: one process, or the process that started the others)
prints it; the others stay quiet.
"""

from __future__ import annotations

import os
import warnings

_said: set[tuple[str, type[Warning]]] = set()


def warn_user(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category)`` once per process, on rank 0 only."""
    if os.environ.get("RANK", "0") != "0" or (message, category) in _said:
        return
    _said.add((message, category))
    warnings.warn(message, category, stacklevel=stacklevel + 1)
