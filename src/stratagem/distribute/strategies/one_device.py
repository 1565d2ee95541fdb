"""OneDeviceStrategy: one replica on one device; what the scope creates is placed there."""

from __future__ import annotations

from typing import final

import torch

from stratagem.comm import LocalCommunicator
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.strategy import Strategy


@final
class OneDeviceStrategy(Strategy):
    """One replica on ``device`` ("cpu", "cuda:0"): the single-device baseline of every parity test."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"OneDeviceStrategy({str(device)!r}): CUDA is not available on this machine")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        super().__init__(DataParallelExtended(LocalCommunicator(dev), dev, name="OneDeviceStrategy"))
