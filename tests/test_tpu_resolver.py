"""TPUClusterResolver and the TPU bootstrap's errors, without torch_xla (the main suite)."""

from __future__ import annotations

import sys

import pytest

import stratagem as sg
from stratagem.cluster import tpu as tpu_mod
from stratagem.cluster_resolver import TPUClusterResolver, TPUUnavailableError


def test_importing_stratagem_does_not_import_torch_xla():
    assert "torch_xla" not in sys.modules


def test_a_remote_tpu_node_address_is_a_clear_error():
    env = {"COLAB_TPU_ADDR": "10.0.0.2:8470"}
    tpu_address = "grpc://" + env["COLAB_TPU_ADDR"]
    with pytest.raises(TPUUnavailableError, match=r"remote TPU node.*PJRT_DEVICE=CPU"):
        TPUClusterResolver(tpu_address, environ=env)


def test_a_local_address_name_or_none_means_this_host():
    for tpu in ("grpc://localhost:8470", "my-tpu", "local", None):
        r = TPUClusterResolver(tpu, environ={"PJRT_DEVICE": "CPU"})
        assert r.num_workers == 1 and r.task_id == 0 and r.check_available() == "CPU"
    assert TPUClusterResolver(environ={"TPU_NAME": "v5e"}).tpu == "v5e"


def test_no_tpu_and_no_pjrt_device_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(tpu_mod, "_has_tpu_chips", lambda: False)
    resolver = sg.cluster_resolver.TPUClusterResolver(tpu=None)
    for call in (sg.connect_to_cluster, sg.initialize_tpu_system, sg.TPUStrategy):
        with pytest.raises(TPUUnavailableError, match=r"no TPU found.*PJRT_DEVICE=CPU"):
            call(resolver)


def test_a_pod_reports_its_workers_and_coordinator():
    env = {"TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}
    r = TPUClusterResolver(environ=env)
    assert (r.task_id, r.num_workers, r.is_pod) == (2, 4, True)
    assert r.coordinator_address == "t0:8476"
    assert r.cluster_spec().workers == ("t0", "t1", "t2", "t3")
    with pytest.raises(ValueError, match="TPU_WORKER_ID=5"):
        TPUClusterResolver(environ={"TPU_WORKER_ID": "5", "TPU_WORKER_HOSTNAMES": "a,b"})


def test_without_torch_xla_the_strategy_says_what_to_install(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # as if not installed
    with pytest.raises(ImportError, match=r"stratagem\[tpu\]"):
        sg.TPUStrategy()
