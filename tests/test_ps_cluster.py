"""A parameter-server cluster in TF_CONFIG: TFConfigClusterResolver.ps_cluster() and PSClusterSpec."""

from __future__ import annotations

import dataclasses
import json

import pytest

from stratagem import cluster_resolver
from stratagem.cluster.ps_spec import PSClusterSpec
from stratagem.cluster.resolvers import TFConfigClusterResolver, detect

CLUSTER = {
    "chief": ["10.0.0.1:2222"],
    "worker": ["10.0.0.2:2222", "10.0.0.3:2222"],
    "ps": ["10.0.0.4:2222", "10.0.0.5:2222"],
}


def env(kind, index, cluster=CLUSTER, **extra):
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}}), **extra}


def test_ps_task_as_given():
    resolver = TFConfigClusterResolver(env("ps", 1))
    spec = resolver.ps_cluster()
    assert spec == PSClusterSpec(
        "10.0.0.1:2222", ("10.0.0.2:2222", "10.0.0.3:2222"), ("10.0.0.4:2222", "10.0.0.5:2222"), "ps", 1,
    )
    assert (resolver.task_type, resolver.task_id) == ("ps", 1)
    assert (spec.rpc_name, spec.address, spec.is_chief) == ("ps:1", "10.0.0.5:2222", False)
    assert (spec.master_addr, spec.master_port) == ("10.0.0.1", 2222)
    assert (spec.num_workers, spec.num_ps, spec.world_size, spec.rank) == (2, 2, 5, 4)
    assert spec.rpc_names == ("chief", "worker:0", "worker:1", "ps:0", "ps:1")
    assert (spec.source, spec.restart_count) == ("tf_config", 0)
    assert resolver.num_workers == 2 and resolver.master() == "10.0.0.5:2222"  # tf: this task's address
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.task_id = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    "kind,index,name,rank", [("chief", 0, "chief", 0), ("worker", 0, "worker:0", 1), ("worker", 1, "worker:1", 2)]
)
def test_every_task_has_its_name(kind, index, name, rank):
    resolver = TFConfigClusterResolver(env(kind, index))
    spec = resolver.ps_cluster()
    assert (spec.rpc_name, spec.rank, spec.is_chief) == (name, rank, kind == "chief")
    assert (resolver.task_type, resolver.task_id) == (kind, index)


def test_restart_count_comes_from_the_environment():
    spec = TFConfigClusterResolver(env("worker", 1, STRATAGEM_RESTART_COUNT="2")).ps_cluster()
    assert spec.restart_count == 2
    assert "worker:1 of a cluster of chief 10.0.0.1:2222, 2 worker(s)" in spec.describe()
    assert "restart 2" in spec.describe()
    with pytest.raises(ValueError, match="STRATAGEM_RESTART_COUNT must be a whole number >= 0, got 'x'"):
        TFConfigClusterResolver(env("worker", 1, STRATAGEM_RESTART_COUNT="x"))


def test_detect_finds_a_ps_cluster_and_repr_describes_it():
    resolver = detect(env("worker", 0))
    assert isinstance(resolver, TFConfigClusterResolver)
    assert repr(resolver).startswith("TFConfigClusterResolver(worker:0 of a cluster of chief")
    assert cluster_resolver.PSClusterSpec is PSClusterSpec


def test_all_reduce_strategies_refuse_a_ps_cluster():
    resolver = TFConfigClusterResolver(env("worker", 0))
    with pytest.raises(ValueError, match="parameter-server cluster .* use ParameterServerStrategy"):
        resolver.cluster_spec()


def test_ps_cluster_of_a_config_without_ps():
    cluster = {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222"]}
    resolver = TFConfigClusterResolver(env("worker", 0, cluster))
    assert resolver.cluster_spec().world_size == 2  # the all-reduce view is unchanged
    with pytest.raises(ValueError, match="TF_CONFIG has no 'ps' job: ParameterServerStrategy needs"):
        resolver.ps_cluster()


@pytest.mark.parametrize(
    "cluster,task,match",
    [
        ({"worker": ["a:1"], "ps": ["b:1"]}, ("worker", 0), r"exactly one 'chief'.*got 0 chief\(s\), 1 worker\(s\), 1 ps"),
        ({"chief": ["a:1", "c:1"], "worker": ["a:2"], "ps": ["b:1"]}, ("chief", 0), r"got 2 chief\(s\)"),
        ({"chief": ["a:1"], "ps": ["b:1"]}, ("ps", 0), r"at least one 'worker'.*0 worker\(s\)"),
        ({"chief": ["a:1"], "worker": ["a:2"], "ps": []}, ("chief", 0), r"at least one 'ps'.*0 ps"),
        ({**CLUSTER, "evaluator": ["e:1"]}, ("chief", 0), r"jobs \['evaluator'\].*only 'chief', 'worker' and 'ps'"),
        (CLUSTER, ("ps", 2), r"is not in the cluster: it has 2 'ps' task\(s\)"),
        (CLUSTER, ("chief", 1), r"is not in the cluster: it has 1 'chief'"),
        (CLUSTER, ("evaluator", 0), "type must be 'chief', 'worker' or 'ps'"),
        (CLUSTER, ("ps", "0"), "index an int"),
        ({**CLUSTER, "ps": ["nohost"]}, ("chief", 0), r"TF_CONFIG ps 0: expected 'host:port', got 'nohost'"),
        ({**CLUSTER, "ps": "a:1"}, ("chief", 0), "job 'ps' must be a list of 'host:port' strings"),
    ],
)
def test_bad_ps_clusters_say_what_is_wrong(cluster, task, match):
    with pytest.raises(ValueError, match=match):
        TFConfigClusterResolver(env(*task, cluster))


def test_spec_checks_its_own_fields():
    with pytest.raises(ValueError, match="task type 'evaluator'"):
        PSClusterSpec("a:1", ("b:1",), ("c:1",), "evaluator", 0)
    with pytest.raises(ValueError, match="task worker:1 is outside the cluster's 1 worker"):
        PSClusterSpec("a:1", ("b:1",), ("c:1",), "worker", 1)
    with pytest.raises(ValueError, match="at least one worker and one ps"):
        PSClusterSpec("a:1", ("b:1",), (), "chief", 0)
    with pytest.raises(ValueError, match="expected 'host:port', got 'a'"):
        PSClusterSpec("a", ("b:1",), ("c:1",), "chief", 0)
    ipv6 = PSClusterSpec("[::1]:2222", ("b:1",), ("c:1",), "chief", 0)
    assert (ipv6.master_addr, ipv6.master_port) == ("::1", 2222)
