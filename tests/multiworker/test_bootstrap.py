"""connect_to_cluster names the address it cannot reach; initialize_system stops workers that
disagree and names the worker and the difference."""

from __future__ import annotations

import time

import pytest
from mw_workers import FAST, bootstrap_worker

from stratagem.cluster.launch import find_free_port
from stratagem.cluster.resolvers import SimpleClusterResolver
from stratagem.comm import CollectiveError
from stratagem.distribute.bootstrap import CommunicationOptions, connect_to_cluster
from stratagem.testing import run_workers


@pytest.mark.timeout(120)
def test_initialize_system_names_the_worker_whose_config_differs():
    results = run_workers(bootstrap_worker, 2, args=({"global_batch": 32}, None), timeout=90, check=False)
    for r in results:
        assert r.returncode == 1, r.stderr[-2000:]
        assert "ClusterConfigurationError: initialize_system: the workers disagree" in r.stderr
        assert "rank 1: config.global_batch=32 (worker 0 has 64)" in r.stderr, r.stderr[-2000:]


@pytest.mark.timeout(120)
def test_initialize_system_names_a_different_torch_version():
    results = run_workers(bootstrap_worker, 2, args=({}, "0.0.1-other"), timeout=90, check=False)
    for r in results:
        assert r.returncode == 1
        assert "rank 1: torch=0.0.1-other (worker 0 has" in r.stderr, r.stderr[-2000:]


def test_connect_names_the_unreachable_address():
    port = find_free_port()
    resolver = SimpleClusterResolver(f"127.0.0.1:{port}", 2, 1)  # nobody hosts the store
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=f"could not reach the rendezvous at 127.0.0.1:{port}"):
        connect_to_cluster(resolver, CommunicationOptions(timeout_seconds=5, failure=FAST.failure), device="cpu")
    # promise: the 5 s rendezvous timeout holds (torch's own client, alone, gave up after 5.7 to
    # 13.6 s); 1.5 s more for a loaded machine
    assert time.monotonic() - start < 5 + 1.5
