"""One TF_CONFIG worker of a failover job across hosts (``python failover_cut_script.py OUT``):
MultiWorkerMirroredStrategy with on_failure="continue" (a dead peer found within 3 s), fit in the
deterministic mode as failover_workers.fit_through_failure trains; each forward pass of worker 2
is counted in OUT/progress2 (the test cuts its host off mid-training). A worker that finishes
writes what it ended with to OUT/rank<r>.json."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

import stratagem as sg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from failover_workers import _data  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    options = sg.FailureOptions(on_failure="continue", heartbeat_seconds=0.5, dead_after_seconds=3.0)
    strategy = sg.MultiWorkerMirroredStrategy(communication_options=sg.CommunicationOptions(timeout_seconds=20), failure=options)
    rank = strategy.extended.replica_id
    sg.experimental.enable_op_determinism(piece_size=4)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.25), nn.Linear(32, 32), nn.Tanh(),
                              nn.Linear(32, 5))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    seen = [0]

    def slow(*_: object) -> None:  # slower steps: the cut comes mid-training
        time.sleep(0.05)
        seen[0] += 1
        if rank == 2:
            (out / "progress2").write_text(str(seen[0]))

    model.register_forward_pre_hook(slow)
    history = sg.fit(model, opt, nn.CrossEntropyLoss(), _data(), epochs=6, global_clipnorm=0.5, strategy=strategy,
                     verbose=0)  # fmt: skip
    digest = hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters()))
    (out / f"rank{rank}.json").write_text(json.dumps({"hash": digest.hexdigest(), "loss": history.history["loss"],
                                                      "replicas": strategy.num_replicas_in_sync}))  # fmt: skip
