"""TF_CONFIG mistakes found at the rendezvous within seconds, with words naming both views
(issue 53): two workers given one index, clusters of different sizes, addresses that differ.
Before, each waited out the 120 s timeout and ended on a misleading message."""

from __future__ import annotations

import time

import pytest
from tf_config_mistakes_workers import join_with, join_with_addresses

from stratagem.testing import run_workers

#: the bound: every process has its clear error within this many seconds (the timeout is 120)
BOUND_S = 15.0


def _results(fn, args, n=2):
    start = time.monotonic()
    results = [r.value for r in run_workers(fn, n, args=args, timeout=90, check=False, allow_stderr=None)]
    return results, time.monotonic() - start


@pytest.mark.timeout(120)
def test_two_workers_given_index_0_are_told_so_at_once():
    results, _ = _results(join_with, ([(0, 2), (0, 2)],))
    for r in results:
        assert r is not None and r["error"] == "ClusterConfigurationError", r
        assert "two processes were given rank 0 (task worker:0" in r["message"], r["message"]
        assert "each with its own task index" in r["message"]
        assert r["seconds"] < BOUND_S, r


@pytest.mark.timeout(120)
def test_a_worker_listing_3_workers_where_the_chief_lists_2_is_told_both_views():
    results, _ = _results(join_with, ([(0, 2), (1, 3)],))
    for r in results:
        assert r is not None and r["error"] == "ClusterConfigurationError", r
        message = r["message"]
        assert "told different clusters" in message, message
        assert "task worker:1 (rank 1" in message and "was given a cluster of 3 workers" in message, message
        assert "the chief, task worker:0 (rank 0" in message and "was given a cluster of 2 workers" in message, message
        assert "cluster worker has 3 entries" in message and "but 2" in message, message
        assert r["seconds"] < BOUND_S, r


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_the_chief_listing_3_workers_where_a_worker_lists_2_is_told_too():
    results, _ = _results(join_with, ([(0, 3), (1, 2)],))
    for r in results:
        assert r is not None and r["error"] == "ClusterConfigurationError", r
        assert "was given a cluster of 2 workers" in r["message"] and "a cluster of 3 workers" in r["message"]
        assert r["seconds"] < BOUND_S, r


@pytest.mark.timeout(120)
def test_a_worker_address_that_differs_is_named():
    results, _ = _results(join_with_addresses, ([1, 7],))
    for r in results:
        assert r is not None and r["error"] == "ClusterConfigurationError", r
        assert "cluster worker 1 is '127.0.0.1:" in r["message"], r["message"]
        assert r["seconds"] < BOUND_S, r


@pytest.mark.timeout(120)
def test_two_workers_given_index_1_of_3_are_told_so():
    results, _ = _results(join_with, ([(0, 3), (1, 3), (1, 3)],), n=3)
    duplicates = [r for r in results if r and r["error"] == "ClusterConfigurationError"]
    assert len(duplicates) == 3, results
    for r in duplicates:
        assert "two processes were given rank 1 (task worker:1)" in r["message"], r["message"]
        assert r["seconds"] < BOUND_S, r


@pytest.mark.timeout(120)
def test_agreeing_tf_configs_still_form_the_job():
    results, _ = _results(join_with, ([(0, 2), (1, 2)],))
    assert [r["error"] for r in results] == [None, None], results
    assert [r["replicas"] for r in results] == [2, 2]


@pytest.mark.timeout(120)
def test_a_worker_never_started_is_named_after_the_timeout():
    results, _ = _results(join_with, ([(0, 3), (1, 3)], 3.0))
    chief, other = results
    assert chief["error"] == "CollectiveError" and "rank 2 never joined the job" in chief["message"], chief
    assert other["error"] == "CollectiveError" and "never joined the job" in other["message"], other
    assert all(3.0 <= r["seconds"] < 3.0 + BOUND_S for r in results), results
