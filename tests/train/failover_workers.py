"""Workers for test_failover.py: fit under FailureOptions(on_failure="continue") while a replica dies."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
import time
from typing import Any

import torch
from torch import nn

import stratagem as sg


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(144, 12, generator=g), torch.randint(0, 5, (144,), generator=g)
    return [(x[i : i + 24], y[i : i + 24]) for i in range(0, 144, 24)]  # 6 global batches of 24


def _die_at(model: nn.Module, call: int, how: str) -> None:
    """This replica dies at its ``call``-th forward pass (a piece of a step, mid-step)."""
    seen = [0]

    def hook(*_: Any) -> None:
        seen[0] += 1
        if seen[0] == call:
            if how == "stop":  # stopped (SIGSTOP) 0.2 s from now for 10 s, then continued
                pid = os.getpid()
                subprocess.Popen(["sh", "-c", f"sleep 0.2; kill -STOP {pid}; sleep 10; kill -CONT {pid}"],
                                 start_new_session=True)  # fmt: skip
                return
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"replica {os.environ.get('RANK')} fails on purpose at forward {call}")

    model.register_forward_pre_hook(hook)


class _DieInCallback(sg.callbacks.Callback):
    """This replica dies in a user callback's ``hook`` at its ``call``-th call (between steps,
    where a Keras-style logger runs)."""

    def __init__(self, hook: str, call: int, how: str) -> None:
        super().__init__()
        self.calls = 0
        self.call, self.how = call, how
        setattr(self, hook, self._maybe_die)

    def _maybe_die(self, *_: Any, **__: Any) -> None:
        self.calls += 1
        if self.calls == self.call:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"replica {os.environ.get('RANK')} fails on purpose in a callback")


def fit_through_failure(replicas: int, victims: dict[int, int], how: str = "kill",
                        deterministic: bool = True, epochs: int = 2, restarts: int = 0,
                        pause: float = 0.0, kind: str = "mirrored", where: str = "forward",
                        validate: bool = False) -> dict[str, Any]:  # fmt: skip
    """fit (AdamW, clipping, dropout) on ``replicas``; each replica of ``victims`` dies at the
    forward pass its value counts (a piece of some step: mid-step), at that call of a callback's
    hook (``where`` the hook's name), or, with ``where="clock"``, by SIGKILL that many
    milliseconds after fit began (a wall-clock moment: wherever the process is then). Returns the
    parameters' SHA-256, the epochs' losses, how many replicas were left and fit's seconds."""
    options = sg.FailureOptions(on_failure="continue", max_restarts=restarts)
    if replicas == 1:
        strategy = None
    elif kind == "multiworker":  # the launcher's variables (run_workers: the store on rank 0, as TF_CONFIG's chief)
        strategy = sg.MultiWorkerMirroredStrategy(failure=options)
    else:
        strategy = sg.MirroredStrategy(devices="cpu", num_replicas=replicas, timeout=60, failure=options)
    if deterministic:
        sg.experimental.enable_op_determinism(piece_size=4)
    torch.manual_seed(0)
    with strategy.scope() if strategy is not None else torch.no_grad():
        model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.25), nn.Linear(32, 32), nn.Tanh(),
                              nn.Linear(32, 5))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank = int(os.environ.get("RANK", "0"))
    callbacks: list[Any] = []
    if rank in victims:
        if where == "forward":
            _die_at(model, victims[rank], how)
        elif where == "clock":
            pass  # armed below, as fit begins
        else:  # a callback's hook: on_train_batch_end, on_train_batch_begin, on_epoch_end...
            callbacks.append(_DieInCallback(where, victims[rank], how))
    if pause:  # slower steps: a replica started again has time to come back mid-training
        model.register_forward_pre_hook(lambda *_: time.sleep(pause))
    if rank in victims and where == "clock":
        timer = threading.Timer(victims[rank] / 1000, os.kill, args=(os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()
    began = time.perf_counter()
    try:
        history = sg.fit(model, opt, nn.CrossEntropyLoss(), _data(), epochs=epochs, global_clipnorm=0.5,
                         strategy=strategy, verbose=0, callbacks=callbacks,
                         validation_data=_data()[:2] if validate else None)  # fmt: skip
    finally:
        sg.experimental.disable_op_determinism()  # a process-wide switch: never left on
    seconds = time.perf_counter() - began
    digest = hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters()))
    left = strategy.num_replicas_in_sync if strategy is not None else 1
    return {"hash": digest.hexdigest(), "loss": [float(v) for v in history.history["loss"]], "replicas": left,
            "seconds": seconds}  # fmt: skip
