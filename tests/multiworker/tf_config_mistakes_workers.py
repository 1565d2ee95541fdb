"""Workers for test_tf_config_mistakes: each process given its own (mistaken) TF_CONFIG."""

from __future__ import annotations

import json
import os
import time
from typing import Any


def _tf_config(cluster: dict[str, list[str]], index: int) -> None:
    os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def join_with(configs: list[tuple[int, int]], timeout: float = 120.0) -> dict[str, Any]:
    """This rank's TF_CONFIG is ``configs[rank]``: (its task index, workers its cluster lists);
    then MultiWorkerMirroredStrategy. Returns what happened and after how long."""
    import stratagem as sg

    rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    index, workers = configs[rank]
    _tf_config({"worker": [f"127.0.0.1:{port + i}" for i in range(workers)]}, index)
    start = time.monotonic()
    try:
        strategy = sg.MultiWorkerMirroredStrategy(
            communication_options=sg.CommunicationOptions(timeout_seconds=timeout)
        )
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"error": None, "replicas": strategy.num_replicas_in_sync, "seconds": time.monotonic() - start}


def join_with_addresses(second_address_by_rank: list[int], timeout: float = 120.0) -> dict[str, Any]:
    """Two workers whose TF_CONFIGs list worker 1 at different ports (``port + offset``)."""
    import stratagem as sg

    rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    _tf_config({"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + second_address_by_rank[rank]}"]}, rank)
    start = time.monotonic()
    try:
        sg.MultiWorkerMirroredStrategy(
            communication_options=sg.CommunicationOptions(timeout_seconds=timeout)
        )
    except Exception as e:  # noqa: BLE001
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}
