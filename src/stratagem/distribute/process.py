"""One process per replica, where users meet it: ``sg.print`` and ``sg.is_chief()``.

TensorFlow runs a MirroredStrategy program in one process; stratagem runs the script once per
replica, so a plain ``print`` prints once per replica. These helpers (Accelerate's
``accelerator.print`` / ``is_main_process``) ask which process is the job's chief, also outside
any ``strategy.scope()``: the strategies this process made say (the chief is chief of all of
them), else the launcher's environment (``RANK``), else this is the only process.
``strategy.main_process_first()`` is the third helper (on the strategy: every process waits on it).
"""

from __future__ import annotations

import builtins
from typing import Any

from stratagem.cluster import ClusterSpec
from stratagem.distribute import context
from stratagem.distribute.strategy import live_strategies


def is_chief() -> bool:
    """Whether this process is the job's chief (rank 0; the coordinator under
    ParameterServerStrategy): the current strategy's answer inside a scope or ``run``, else
    every strategy this process made must say so; before any strategy, the launcher's ``RANK``
    (torchrun, ``stratagem run``, a self-launched replica) decides."""
    current = context.current_strategy()
    if current is not None:
        return bool(current.is_chief)
    made = live_strategies()
    if made:
        return all(s.is_chief for s in made)
    spec = ClusterSpec.from_environ()
    return spec is None or spec.is_chief


def print(*args: Any, **kwargs: Any) -> None:
    """``print(*args, **kwargs)`` on the chief only, so a line appears once per job rather than
    once per replica. It is not a collective: the other processes return at once. To print
    every replica's part of a value, gather it first on every replica
    (``parts = strategy.experimental_local_results(v)``), then ``sg.print(parts)``."""
    if is_chief():
        builtins.print(*args, **kwargs)
