"""TensorFlow's device strings wherever a device is given: one reading (devices.to_torch_device)."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from stratagem.distribute.devices import plan_devices, to_torch_device


@pytest.mark.parametrize("name", [
    "CPU:0", "/cpu:0", "cpu", "cpu:0", "/device:CPU:0", "device:CPU:0",
    "/job:localhost/replica:0/task:0/device:CPU:0", torch.device("cpu"),
])
def test_tf_s_cpu_names_are_the_cpu(name):
    assert to_torch_device(name).type == "cpu"
    assert sg.OneDeviceStrategy(name).device.type == "cpu"


@pytest.mark.parametrize(("name", "want"), [
    ("GPU:0", "cuda:0"), ("/gpu:1", "cuda:1"), ("/device:GPU:1", "cuda:1"), ("gpu:0", "cuda:0"),
    ("/job:localhost/replica:0/task:0/device:GPU:0", "cuda:0"), ("cuda:1", "cuda:1"), ("mps", "mps"),
])
def test_gpu_names_are_cuda_devices(name, want):
    assert to_torch_device(name) == torch.device(want)


def test_mirrored_device_lists_take_tf_s_names():
    assert plan_devices(["GPU:0", "GPU:1"], None, 2, what="MirroredStrategy") == ["cuda:0", "cuda:1"]
    assert plan_devices(["CPU:0", "/cpu:0"], None, 0, what="MirroredStrategy") == ["cpu", "cpu"]
    with pytest.raises(ValueError, match=r"device 'GPU:0' \(cuda:0\) of replica 0 is not available: this machine has no GPU"):
        plan_devices(["GPU:0", "GPU:1"], None, 0, what="MirroredStrategy")


@pytest.mark.parametrize("name", ["banana", "", "CPU:zero", "/job:localhost/replica:0/task:0/device:FOO:0"])
def test_nonsense_names_what_was_received(name):
    with pytest.raises(ValueError, match=f"OneDeviceStrategy\\({name!r}\\).*{name!r}.*use 'cpu', 'cuda'"):
        sg.OneDeviceStrategy(name)


def test_a_device_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="a device is a string or a torch.device, got 0 \\(int\\)"):
        to_torch_device(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for a machine without a GPU")
def test_a_gpu_on_a_machine_without_one_names_the_cpu():
    with pytest.raises(ValueError, match="OneDeviceStrategy\\('GPU:0'\\): asks for a GPU, but CUDA is not available"):
        sg.OneDeviceStrategy("GPU:0")
