"""The device plan (pure): tf.distribute's rules, CPU replicas on request, never two replicas on one GPU."""

from __future__ import annotations

import pytest

from stratagem.distribute.devices import plan_devices


def test_no_arguments_use_every_gpu_or_one_cpu_replica():
    assert plan_devices(None, None, 0, what="M") == ["cpu"]
    assert plan_devices(None, None, 2, what="M") == ["cuda:0", "cuda:1"]
    assert plan_devices(None, 3, 0, what="M") == ["cpu"] * 3  # no GPU: N CPU replicas
    assert plan_devices(None, 1, 4, what="M") == ["cuda:0"]


def test_cpu_and_cuda_shorthands_and_lists():
    assert plan_devices("cpu", 2, 1, what="M") == ["cpu", "cpu"]
    assert plan_devices("cpu", None, 8, what="M") == ["cpu"]
    assert plan_devices("cuda", None, 2, what="M") == ["cuda:0", "cuda:1"]
    assert plan_devices(["cuda:1", "gpu:0"], None, 2, what="M") == ["cuda:1", "cuda:0"]
    assert plan_devices(["cpu"] * 4, 4, 1, what="M") == ["cpu"] * 4


def test_more_replicas_than_gpus_names_the_cpu_way():
    with pytest.raises(ValueError, match=r"2 replicas but this machine has 1 GPU.*devices='cpu'.*\['cpu'\] \* 2"):
        plan_devices(None, 2, 1, what="MirroredStrategy")
    with pytest.raises(ValueError, match="no GPU"):
        plan_devices("cuda", 2, 0, what="M")


def test_two_replicas_never_share_a_gpu():
    with pytest.raises(ValueError, match="replicas 0 and 1 would both use cuda:0"):
        plan_devices(["cuda:0", "cuda"], None, 1, what="M")
    with pytest.raises(ValueError, match="cuda:3 of replica 0 is not available"):
        plan_devices(["cuda:3"], None, 2, what="M")
    with pytest.raises(ValueError, match="gives 2 replicas but num_replicas=3"):
        plan_devices(["cpu", "cpu"], 3, 0, what="M")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        plan_devices(["tpu"], None, 0, what="M")
