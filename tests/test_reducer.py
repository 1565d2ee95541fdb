"""The gradient reducer in one process, against a recording communicator of 2 'replicas'."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stratagem.comm import LocalCommunicator
from stratagem.comm.reducer import GradientReducer


class RecordingComm(LocalCommunicator):
    """Pretends to be 2 identical replicas: an all-reduce doubles the buffer; launches are logged."""

    def __init__(self, log: list[str]) -> None:
        super().__init__("cpu")
        self.world_size = 2
        self.log = log

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        self.log.append(f"launch {tensor.numel()}")
        tensor.mul_(2)
        return super().all_reduce_async(tensor)


def test_buckets_launch_in_plan_order_during_backward_and_sum_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    log: list[str] = []
    # tiny caps: every bucket closes after ~one parameter, so there are several buckets
    reducer = GradientReducer(RecordingComm(log), params, names, first_bucket_bytes=16, bucket_bytes=64)
    assert len(reducer.buckets) >= 3
    # the first bucket holds the last layer's parameters (their gradients are ready first)
    assert reducer.buckets[0].params[0] == len(params) - 1
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: log.append(f"ready {i}"))
    x = torch.randn(8, 4)
    model(x).sum().backward()
    # overlap: the first bucket is launched before the first layer's gradients are ready
    assert log.index(next(e for e in log if e.startswith("launch"))) < log.index("ready 0")
    launches = [e for e in log if e.startswith("launch")]
    assert len(launches) == len(reducer.buckets)
    assert launches == [f"launch {b.numel + len(b.params)}" for b in reducer.buckets]
    # gradients are the sum over the 2 replicas, i.e. twice the local gradient
    reference = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    reference.load_state_dict(model.state_dict())
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad)


def test_parameters_without_gradients_keep_none_and_mean_divides():
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    reducer = GradientReducer(RecordingComm([]), [a, b], ["a", "b"], op="mean")
    (a * 3).sum().backward()  # b takes no part in this backward
    assert b.grad is None
    torch.testing.assert_close(a.grad, torch.full((3,), 3.0))  # (3 + 3) / 2 replicas
    reducer.remove()
    (a * 1).sum().backward()
    torch.testing.assert_close(a.grad, torch.full((3,), 4.0))  # no reduction after remove()


def test_accumulating_over_backward_passes_reduces_only_the_new_part():
    # two identical 'replicas': each reduction doubles what it is given
    w = nn.Parameter(torch.ones(3))
    GradientReducer(RecordingComm([]), [w], ["w"])
    (w * 1).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))  # 1 + 1
    (w * 2).sum().backward()  # no zero_grad: accumulate
    torch.testing.assert_close(w.grad, torch.full((3,), 6.0))  # 2 + (2 + 2), not 2 * (2 + 2)
    w.grad = None
    (w * 1).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))
    w.grad.zero_()  # zero_grad(set_to_none=False)
    (w * 1).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))


def test_gradients_accumulated_while_disabled_are_reduced_whole():
    w = nn.Parameter(torch.ones(2))
    reducer = GradientReducer(RecordingComm([]), [w], ["w"])
    reducer.enabled = False  # like the pipeline's micro-batches (DDP's no_sync)
    (w * 1).sum().backward()
    (w * 1).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((2,), 2.0))  # local only
    reducer.enabled = True
    (w * 1).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((2,), 6.0))  # (1 + 1 + 1) reduced over 2
