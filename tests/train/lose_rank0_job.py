"""A self-launched job (``python lose_rank0_job.py OUT VICTIM CALL``) of 3 replicas under
``on_failure="continue"`` (deterministic mode) in which replica VICTIM, rank 0 too, is SIGKILLed
at its CALL-th forward pass; each replica that finishes writes its result to OUT/<rank>.json."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from failover_workers import fit_through_failure  # noqa: E402

out, victim, call = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
result = fit_through_failure(3, {victim: call}, "kill")
rank = int(os.environ.get("RANK", "0"))
(out / f"{rank}.json").write_text(json.dumps({**result, "pid": os.getpid()}))
