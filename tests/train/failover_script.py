"""Run as a script (``python failover_script.py OUT VICTIM CALL [AGAIN_CALL]``): MirroredStrategy(3)
starts its replicas itself, with on_failure="continue" and max_restarts=1; replica VICTIM is killed
at its CALL-th forward pass, started again by rank 0, and comes back into the running fit (and,
with AGAIN_CALL, is killed again at its AGAIN_CALL-th forward pass after it came back). Each
process that finishes writes what it ended with to OUT/rank<r>[-again].json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from failover_workers import fit_through_failure  # noqa: E402

if __name__ == "__main__":
    out, victim, call = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    again_call = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # the replica started again dies too
    again = os.environ.get("STRATAGEM_REPLACEMENT") == "1"
    victims = ({victim: again_call} if again_call else {}) if again else {victim: call}
    result = fit_through_failure(3, victims, epochs=10, restarts=1, pause=0.05)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}{'-again' if again else ''}.json").write_text(json.dumps(result))
