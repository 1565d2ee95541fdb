"""OneDeviceStrategy: one replica on one device; what the scope creates is placed there."""

from __future__ import annotations

from typing import final

import torch

from stratagem.comm import LocalCommunicator
from stratagem.distribute.devices import to_torch_device
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.strategy import Strategy


@final
class OneDeviceStrategy(Strategy):
    """One replica on ``device``: torch's names ("cpu", "cuda:0") or TensorFlow's ("CPU:0",
    "/cpu:0", "GPU:0", "/device:GPU:1", "/job:localhost/replica:0/task:0/device:CPU:0").
    The single-device baseline of every parity test."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        what = f"OneDeviceStrategy({str(device)!r})"
        dev = to_torch_device(device, what=what)  # torch's names or TensorFlow's ("CPU:0", "/gpu:0")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{what}: asks for a GPU, but CUDA is not available on this machine (it has no GPU); use '/cpu:0' or 'cpu'")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{what}: asks for cuda:{dev.index}, but this machine has {torch.cuda.device_count()} GPU(s)")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        super().__init__(DataParallelExtended(LocalCommunicator(dev), dev, name="OneDeviceStrategy"))
