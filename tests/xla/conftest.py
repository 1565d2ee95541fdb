"""The XLA tests: run by scripts/test_xla.sh in its own environment (torch 2.9 + torch-xla 2.9)
with PJRT_DEVICE=CPU, once per CPU_NUM_DEVICES (SPMD fixes the device count when the runtime
starts). Without torch_xla, or without PJRT_DEVICE=CPU, nothing here is collected."""

from __future__ import annotations

import importlib.util
import os

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("torch_xla") is None or os.environ.get("PJRT_DEVICE") != "CPU":
    collect_ignore_glob = ["test_*.py"]
