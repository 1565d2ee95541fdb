"""CUDA paths (NCCL, device placement); skipped cleanly on machines without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.testing import run_workers
from tests_gpu_workers import nccl_one_worker, nccl_parity_worker  # noqa: F401  (importable by the workers)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]


def test_one_device_strategy_places_the_model_on_the_gpu():
    s = sg.OneDeviceStrategy("cuda:0")
    with s.scope():
        model = nn.Linear(4, 2)
    assert model.weight.device.type == "cuda"
    out = s.run(lambda x: model(x), args=(torch.ones(3, 4),))
    assert out.device.type == "cuda"


@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL replicas need 2 GPUs")
def test_mirrored_over_nccl_matches_single_device():
    assert [r.value for r in run_workers(nccl_parity_worker, 2, timeout=220)] == ["ok", "ok"]


def _train(strategy, data, precision="32", epochs=2):
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hist = sg.fit(model, opt, nn.CrossEntropyLoss(), data, epochs=epochs, verbose=0,
                  metrics=["sparse_categorical_accuracy"], precision=precision)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, hist.history


def _data():
    from stratagem.data import Dataset

    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
    return Dataset.from_tensor_slices((x, y)).shuffle(96, seed=0).batch(16)


def test_one_device_on_cuda_matches_cpu_training_and_fit_feeds_the_gpu():
    gpu, gpu_hist = _train(sg.OneDeviceStrategy("cuda"), _data())
    cpu, cpu_hist = _train(sg.OneDeviceStrategy("cpu"), _data())
    for k in cpu:
        torch.testing.assert_close(gpu[k], cpu[k], rtol=1e-4, atol=1e-5)
    assert gpu_hist["loss"] == pytest.approx(cpu_hist["loss"], rel=1e-4)


def test_bf16_on_cuda_trains_close_to_fp32():
    bf16, _ = _train(sg.OneDeviceStrategy("cuda"), _data(), precision="bf16")
    fp32, _ = _train(sg.OneDeviceStrategy("cuda"), _data())
    for k in fp32:
        torch.testing.assert_close(bf16[k], fp32[k], rtol=5e-2, atol=5e-2)


def test_function_on_cuda_matches_eager():
    s = sg.OneDeviceStrategy("cuda")
    torch.manual_seed(0)
    with s.scope():
        model = nn.Linear(8, 3)
    x = torch.randn(4, 8)
    eager = s.run(lambda v: model(v), args=(x,))
    compiled = s.run(sg.function(lambda v: model(v), jit_compile=True), args=(x,))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_device_feed_copies_ahead_on_a_side_stream_and_resumes_exactly():
    from stratagem.distribute.engines.device_feed import DeviceFeed

    ds = _data()
    whole = [b[0].tolist() for b in ds.iterator(epoch=0)]
    feed = DeviceFeed(ds.iterator(epoch=0), torch.device("cuda", 0), depth=2)
    head = [next(feed) for _ in range(2)]
    assert all(t.device.type == "cuda" for b in head for t in b)
    rest = [b[0].tolist() for b in DeviceFeed(ds.iterator_from_state(feed.state_dict()), torch.device("cuda", 0), 2)]
    assert [b[0].tolist() for b in head] + rest == whole


@pytest.mark.timeout(240)
def test_nccl_at_world_size_one_and_pipeline_stage_on_the_gpu():
    assert [r.value for r in run_workers(nccl_one_worker, 1, timeout=220)] == ["ok"]
