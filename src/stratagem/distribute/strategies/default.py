"""The default strategy: what ``get_strategy()`` returns outside any scope (one process, no-op)."""

from __future__ import annotations

from typing import final

from stratagem.comm import LocalCommunicator
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.strategy import Strategy


@final
class DefaultStrategy(Strategy):
    """``run(fn)`` calls ``fn``; ``reduce`` returns the value (reduced along ``axis`` if given)."""

    def __init__(self) -> None:
        super().__init__(DataParallelExtended(LocalCommunicator("cpu"), None, mirror=False, name="default"))
