"""The rendezvous's comparison of cluster views at many ranks: the real control-plane code
(``distribute.views.compare_views``) over a real TCPStore, one thread per simulated rank. The
store operations each rank makes do not grow with the job (design point: 4,096 ranks)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from typing import Any

import pytest

from stratagem.cluster import find_free_port
from stratagem.cluster.resolvers import TFConfigClusterResolver
from stratagem.comm import communicator
from stratagem.distribute import views


class _Counting:
    """A store that counts the operations made through it."""

    def __init__(self, store: Any, counts: Counter) -> None:
        self._store, self._counts = store, counts

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any, **kw: Any) -> Any:
            self._counts[name] += 1
            return method(*args, **kw)

        return call


def _simulate(n: int, port: int, odd: dict[int, list[str]] | None = None, timeout: float = 60.0):
    """``n`` ranks meet; rank r's TF_CONFIG lists ``odd[r]`` as workers if given. Returns each
    rank's outcome and store operations."""
    addresses = [f"127.0.0.1:{port + i}" for i in range(n)]
    results: list[Any] = [None] * n
    counts = [Counter() for _ in range(n)]
    real = communicator.connect_store
    local = threading.local()

    def counting_connect(*args: Any, **kw: Any) -> Any:
        return _Counting(real(*args, **kw), counts[local.rank])

    def rank(r: int) -> None:
        local.rank = r
        workers = (odd or {}).get(r, addresses)
        resolver = TFConfigClusterResolver(tf_config=json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": r}}))  # fmt: skip
        try:
            kept = views.compare_views(resolver.cluster_spec(), timeout=timeout, host=r == 0)
            results[r] = ("ok", kept)
        except Exception as e:  # noqa: BLE001 - the outcome is the test's
            results[r] = (type(e).__name__, str(e))

    communicator.connect_store = counting_connect  # type: ignore[assignment]
    try:
        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 10)
        assert not any(t.is_alive() for t in threads), "a simulated rank is still waiting"
    finally:
        communicator.connect_store = real  # type: ignore[assignment]
    return results, counts


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_agreeing_views_meet_with_store_operations_per_rank_that_do_not_grow_with_the_job():
    ops = {}
    for n in (4, 64):
        results, counts = _simulate(n, find_free_port())
        assert [r[0] for r in results] == ["ok"] * n, results
        others = {sum(c.values()) for c in counts[1:]}
        ops[n] = (sum(counts[0].values()), max(others))
    assert ops[4] == ops[64], ops  # the chief's and every other rank's, alike at 4 and 64 ranks


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_one_rank_of_64_told_another_cluster_stops_every_rank_naming_it():
    port = find_free_port()
    wrong = [f"127.0.0.1:{port + i}" for i in range(64)]
    wrong[12] = "10.1.2.3:2222"
    results, _ = _simulate(64, port, odd={37: wrong})
    assert {r[0] for r in results} == {"ClusterConfigurationError"}, results
    for _, message in results:
        assert "task worker:37 (rank 37" in message, message
        assert "cluster worker 12 is '10.1.2.3:2222' here but '127.0.0.1:" in message, message
