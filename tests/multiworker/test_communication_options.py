"""TF's ``CommunicationOptions(implementation=, bytes_per_pack=, timeout_seconds=)``: each has its
torch meaning (the backend, the gradient reducer's bucket size, the collectives' timeout)."""

from __future__ import annotations

import comm_options_workers
import pytest
import torch

import stratagem as sg
from stratagem.cluster.resolvers import SimpleClusterResolver
from stratagem.distribute.bootstrap import (
    NO_TIMEOUT_SECONDS,
    CommunicationImplementation,
    CommunicationOptions,
)
from stratagem.testing import run_workers


def test_tf_s_arguments_and_their_defaults():
    o = sg.CommunicationOptions()
    assert (o.bytes_per_pack, o.timeout_seconds, o.implementation) == (0, 120.0, CommunicationImplementation.AUTO)
    assert o.bucket_bytes == 25 * 1024 * 1024
    o = sg.CommunicationOptions(bytes_per_pack=50 * 1024 * 1024, timeout_seconds=None, implementation="nccl")
    assert o.implementation is sg.CommunicationImplementation.NCCL
    assert o.bucket_bytes == 50 * 1024 * 1024
    assert o.timeout_seconds == o.timeout == NO_TIMEOUT_SECONDS  # TF's None: torch's own bound
    assert sg.CommunicationOptions(implementation="RING").implementation is CommunicationImplementation.RING
    # positional, in TF's order
    assert sg.CommunicationOptions(1024, 5.0).bucket_bytes == 1024


def test_tf_s_own_enum_member_is_read_by_name():
    class TFEnum:  # stands for tf.distribute.experimental.CommunicationImplementation.NCCL
        name = "NCCL"

    assert CommunicationOptions(implementation=TFEnum()).implementation is CommunicationImplementation.NCCL


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"implementation": "MPI"}, "takes CommunicationImplementation.AUTO, RING or NCCL"),
    ({"bytes_per_pack": -1}, "bytes_per_pack=...) takes a whole number of bytes >= 0"),
    ({"bytes_per_pack": 1.5}, "bytes_per_pack=...) takes a whole number of bytes >= 0"),
    ({"timeout_seconds": 0}, "timeout_seconds=...) takes a number > 0 or None"),
])
def test_nonsense_is_a_clear_error(kwargs, said):
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        CommunicationOptions(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for a machine without CUDA")
def test_nccl_without_cuda_names_what_to_use():
    options = sg.CommunicationOptions(implementation=sg.CommunicationImplementation.NCCL)
    with pytest.raises(ValueError, match="needs CUDA GPUs, and CUDA is not available.*use CommunicationImplementation.RING or AUTO"):
        sg.MultiWorkerMirroredStrategy(communication_options=options)
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        sg.connect_to_cluster(SimpleClusterResolver("127.0.0.1:1", 1, 0), options)


def test_nccl_with_cpu_devices_and_ring_with_gpu_devices_are_refused():
    nccl = CommunicationOptions(implementation="NCCL")
    with pytest.raises(ValueError, match="implementation=NCCL\\) runs on GPU replicas but devices='cpu'"):
        nccl.devices("cpu", 1, "MultiWorkerMirroredStrategy")
    ring = CommunicationOptions(implementation="RING")
    with pytest.raises(ValueError, match="implementation=RING\\) runs gloo on CPU replicas but devices='/gpu:0'"):
        ring.devices("/gpu:0", 1, "MultiWorkerMirroredStrategy")


def test_each_implementation_picks_its_devices():
    assert CommunicationOptions(implementation="RING").devices(None, 8, "w") == "cpu"  # gloo, even with GPUs
    assert CommunicationOptions(implementation="NCCL").devices(None, 8, "w") == "cuda"
    assert CommunicationOptions().devices(None, 8, "w") is None  # AUTO: the GPUs when there are, else the CPU
    assert CommunicationOptions().devices("CPU:0", 8, "w") == "CPU:0"


def test_one_process_multi_worker_takes_tf_s_call():
    """TF's multi-worker tutorial's line, on a CPU machine with RING; the options reach the strategy."""
    options = sg.CommunicationOptions(implementation=sg.CommunicationImplementation.RING, timeout_seconds=30,
                                      bytes_per_pack=4096)
    strategy = sg.MultiWorkerMirroredStrategy(communication_options=options)
    assert strategy.device == torch.device("cpu")
    assert strategy.communication_options.bucket_bytes == 4096


@pytest.mark.timeout(150)
def test_bytes_per_pack_sets_the_gradient_buckets():
    """Two gloo workers (RING): ``bytes_per_pack`` is the gradient reducer's bucket size."""
    small = run_workers(comm_options_workers.bucket_plan, 2, args=(64,), timeout=120)
    large = run_workers(comm_options_workers.bucket_plan, 2, args=(0,), timeout=120)
    # 64-byte packs: each gradient its own bucket (the last layer's 4-byte bias joins its weight),
    # in the order backward makes them; TF's default (0: 25 MB) holds them all in one
    assert [r.value for r in small] == [[(5, 4), (3,), (2,), (1,), (0,)]] * 2
    assert [r.value for r in large] == [[(5, 4, 3, 2, 1, 0)]] * 2
