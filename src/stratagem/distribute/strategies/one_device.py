"""OneDeviceStrategy: one replica on one device; what the scope creates is placed there."""

from __future__ import annotations

from typing import final

import torch

from stratagem.comm import LocalCommunicator
from stratagem.distribute.devices import torch_device_name
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.strategy import Strategy


@final
class OneDeviceStrategy(Strategy):
    """One replica on ``device``: torch's names ("cpu", "cuda:0") or TensorFlow's ("/cpu:0",
    "/gpu:0", "/device:GPU:1"). The single-device baseline of every parity test."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        what = f"OneDeviceStrategy({str(device)!r})"
        if isinstance(device, torch.device):
            dev = device
        elif str(device).startswith("/") or str(device).lower().startswith(("gpu", "device:")):
            dev = torch.device(torch_device_name(device, what=what))  # TensorFlow's names
        else:
            dev = torch.device(device)  # torch's: "cpu", "cuda:1", "mps", ...
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{what}: asks for a GPU, but CUDA is not available on this machine (it has no GPU); use '/cpu:0' or 'cpu'")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{what}: asks for cuda:{dev.index}, but this machine has {torch.cuda.device_count()} GPU(s)")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        super().__init__(DataParallelExtended(LocalCommunicator(dev), dev, name="OneDeviceStrategy"))
