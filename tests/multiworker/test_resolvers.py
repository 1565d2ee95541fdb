"""Cluster resolvers read their environment once into a frozen ClusterSpec."""

from __future__ import annotations

import dataclasses
import json

import pytest

from stratagem.cluster import ClusterSpec
from stratagem.cluster.resolvers import (
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    detect,
    expand_hostlist,
)


def tf_config(index, kind="worker", chief=False):
    cluster = {"worker": ["10.0.0.2:2222", "10.0.0.3:2222"]}
    if chief:
        cluster["chief"] = ["10.0.0.1:2222"]
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})}


def test_tf_config_worker_zero_is_chief():
    spec = TFConfigClusterResolver(tf_config(1)).cluster_spec()
    assert (spec.rank, spec.world_size, spec.task_index) == (1, 2, 1)
    assert (spec.master_addr, spec.master_port) == ("10.0.0.2", 2222)
    assert spec.workers == ("10.0.0.2:2222", "10.0.0.3:2222")
    assert not spec.is_chief
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rank = 0  # type: ignore[misc]


def test_tf_config_with_chief_job_puts_it_first():
    spec = TFConfigClusterResolver(tf_config(0, chief=True)).cluster_spec()
    assert (spec.rank, spec.world_size, spec.master) == (1, 3, "10.0.0.1:2222")
    chief = TFConfigClusterResolver(tf_config(0, "chief", chief=True))
    assert chief.cluster_spec().is_chief and chief.task_type == "chief"


@pytest.mark.parametrize(
    "text,match",
    [("{", "not valid JSON"), ('{"cluster": {"ps": ["a:1"]}, "task": {}}', "parameter servers"),
     ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}', "not in the cluster"),
     ('{"cluster": {"worker": ["nohost"]}, "task": {"type": "worker", "index": 0}}', "host:port")],
)
def test_tf_config_errors_say_what_is_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        TFConfigClusterResolver({"TF_CONFIG": text})


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29500",
           "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    spec = TorchrunClusterResolver(env).cluster_spec()
    assert (spec.rank, spec.world_size, spec.local_rank, spec.task_index, spec.num_workers) == (3, 4, 1, 1, 2)
    assert spec.agent_store and spec.restart_count == 2 and spec.master == "10.1.1.1:29500"
    assert spec == ClusterSpec.from_environ(env)  # one spec type for every launcher
    assert ClusterSpec.from_environ(spec.to_environ()) == dataclasses.replace(
        spec, restart_count=0, agent_store=False
    )
    with pytest.raises(ValueError, match="stratagem run"):
        TorchrunClusterResolver({})


def test_slurm_environment_and_hostlist():
    assert expand_hostlist("node[01-03,7],gpu5") == ["node01", "node02", "node03", "node7", "gpu5"]
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_TASKS_PER_NODE": "2(x4)"}
    spec = SlurmClusterResolver(env).cluster_spec()
    assert (spec.rank, spec.world_size, spec.local_rank, spec.local_world_size) == (5, 8, 1, 2)
    assert spec.workers == ("n1", "n2", "n3", "n4") and spec.task_index == 2
    assert spec.master_addr == "n1" and spec.master_port == 15000 + 123456 % 10000


def test_simple_resolver_reads_no_environment(monkeypatch):
    monkeypatch.setenv("RANK", "7")
    spec = SimpleClusterResolver("[::1]:1234", 3, 2).cluster_spec()
    assert (spec.rank, spec.world_size, spec.master_addr, spec.master_port) == (2, 3, "::1", 1234)
    with pytest.raises(ValueError, match="task_index"):
        SimpleClusterResolver("h:1", 2, 2)


def test_detect_prefers_tf_config_then_torchrun_then_slurm():
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a"}
    assert isinstance(detect({**tf_config(0), **torchrun}), TFConfigClusterResolver)
    assert isinstance(detect({**torchrun, **slurm}), TorchrunClusterResolver)
    assert isinstance(detect(slurm), SlurmClusterResolver)
    alone = detect({})
    assert isinstance(alone, SimpleClusterResolver) and alone.cluster_spec().world_size == 1
