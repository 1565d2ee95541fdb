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
    reference = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    reference.load_state_dict(model.state_dict())
    reference(x).sum().backward()
    for learning in (True, False):
        log.clear()
        model.zero_grad()
        model(x).sum().backward()
        first = log.index(next(e for e in log if e.startswith("launch")))
        if learning:  # the first pass records the order: every bucket starts at its end
            assert first > max(log.index(f"ready {i}") for i in range(len(params)))
        else:  # overlap: the first bucket is launched before the first layer's gradients are ready
            assert first < log.index("ready 0")
        launches = [e for e in log if e.startswith("launch")]
        assert launches == [f"launch {b.numel + len(b.params) + 1}" for b in reducer.buckets]
        # gradients are the sum over the 2 replicas, i.e. twice the local gradient
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, 2 * q.grad)


class TiedLM(nn.Module):
    """nanoGPT's tie: the head's weight, registered last, is the token embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 10, bias=False)
        self.wte.weight = self.head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.wte(idx)))


def test_buckets_follow_the_order_gradients_become_ready():
    # registration order as a strategy's scope sees it: the tied weight comes last, so the
    # first planned bucket holds it, and its gradient is complete only at the end of backward
    torch.manual_seed(0)
    model = TiedLM()
    params = [*model.body.parameters(), model.head.weight]
    log: list[str] = []
    reducer = GradientReducer(RecordingComm(log), params, [str(i) for i in range(len(params))],
                              first_bucket_bytes=16, bucket_bytes=64)  # fmt: skip
    assert reducer.buckets[0].params[0] == len(params) - 1
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: log.append(f"ready {i}"))
    idx = torch.randint(0, 10, (6,))
    reference = TiedLM()
    reference.load_state_dict(model.state_dict())
    reference(idx).square().sum().backward()
    expected = [2 * p.grad for p in [*reference.body.parameters(), reference.head.weight]]
    for _ in range(3):
        log.clear()
        model.zero_grad()
        model(idx).square().sum().backward()
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.grad, e)
    # learned: the tied weight (ready last) is in the last bucket, and the first bucket starts
    # while the body's gradients are still being computed
    assert reducer.buckets[-1].params == (len(params) - 1,)
    ready = [e for e in log if e.startswith("ready")]
    first = log.index(next(e for e in log if e.startswith("launch")))
    assert ready[-1] == f"ready {len(params) - 1}" and first < log.index(ready[-2])


class OrderFromRank0(RecordingComm):
    """A replica whose rank 0 saw another order: the all-gather brings rank 0's first."""

    def __init__(self, order: list[int]) -> None:
        super().__init__([])
        self.order = order

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [torch.tensor(self.order), tensor]


def test_the_learned_order_is_rank_0s():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    params = list(model.parameters())
    order = [0, 2, 1, 3]  # not this replica's
    reducer = GradientReducer(OrderFromRank0(order), params, ["a", "b", "c", "d"], first_bucket_bytes=1, bucket_bytes=1)
    model(torch.randn(2, 4)).sum().backward()
    assert [b.params for b in reducer.buckets] == [(0,), (2,), (1,), (3,)]
    reducer.relearn()  # the members changed: the next pass records and agrees again
    assert reducer.learning
    model(torch.randn(2, 4)).sum().backward()
    assert not reducer.learning


def test_a_model_no_replica_trains_is_not_reduced_until_one_does():
    # two models in one reducer (a strategy's scope): only the one trained is all-reduced; when
    # the other gets gradients (on any replica), they are reduced that pass and it joins the plan
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    params = [*a.parameters(), *b.parameters()]
    log: list[str] = []
    reducer = GradientReducer(RecordingComm(log), params, ["aw", "ab", "bw", "bb"])
    x = torch.randn(3, 4)
    for _ in range(3):
        log.clear()
        a.zero_grad()
        a(x).sum().backward()
        assert b.weight.grad is None
    a_size = sum(p.numel() for p in a.parameters())
    assert log == [f"launch {a_size + 2 + 1}"]  # a's bucket only (its 2 flags and the extra)
    b(x).square().sum().backward()  # now b: reduced at once (twice the local gradient)
    expected = torch.autograd.grad(b(x).square().sum(), [b.weight])[0]  # (.grad left alone)
    torch.testing.assert_close(b.weight.grad, 2 * expected)
    assert reducer.learning  # planned again at the next pass, b included
    a.zero_grad()
    b.zero_grad()
    a(x).sum().backward()  # a only, while planning again: b, once trained, stays planned
    assert {i for bk in reducer.buckets[: reducer._live] for i in bk.params} == {0, 1, 2, 3}
    assert not reducer.learning
    b(x).square().sum().backward()
    torch.testing.assert_close(b.weight.grad, 2 * expected)


def test_gradients_accumulated_without_sync_are_reduced_even_if_the_last_pass_does_not_touch_them():
    # the no_sync micro-steps gave b a gradient, the reducing pass touches only a: b's
    # accumulated gradient is still reduced (in the learning pass and after)
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    reducer = GradientReducer(RecordingComm([]), [a, b], ["a", "b"])
    for _ in range(2):
        a.grad = b.grad = None
        reducer.enabled = False
        (b * 3).sum().backward()
        reducer.enabled = True
        (a * 1).sum().backward()
        torch.testing.assert_close(a.grad, torch.full((3,), 2.0))
        torch.testing.assert_close(b.grad, torch.full((2,), 6.0))


def test_autograd_grad_with_respect_to_parameters_leaves_grad_alone():
    # the hook that sets a reduced .grad aside fires for torch.autograd.grad too, which then
    # accumulates nothing: the .grad is put back at that pass's end (it was left None)
    w = nn.Parameter(torch.ones(3))
    GradientReducer(RecordingComm([]), [w], ["w"])
    (w * 1).sum().backward()
    (g,) = torch.autograd.grad((w * 5).sum(), [w])
    torch.testing.assert_close(g, torch.full((3,), 5.0))
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))
    (w * 2).sum().backward()  # accumulating on top: still only the new part reduced
    torch.testing.assert_close(w.grad, torch.full((3,), 6.0))


def test_autograd_grad_leaves_grad_alone_while_another_reduced_grad_is_set_aside():
    # a no_sync pass set a's reduced .grad aside (until the next reducing pass adds it back);
    # an autograd.grad pass over b then must still put b's back
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    reducer = GradientReducer(RecordingComm([]), [a, b], ["a", "b"])
    (a * 1).sum().backward()
    (b * 1).sum().backward()
    reducer.enabled = False
    (a * 1).sum().backward()  # a's reduced 2.0 set aside; .grad holds the new 1.0
    reducer.enabled = True
    torch.autograd.grad((b * 5).sum(), [b])
    torch.testing.assert_close(b.grad, torch.full((2,), 2.0))
    (a * 1).sum().backward()  # 2 (set aside) + reduced(1 + 1) * 2
    torch.testing.assert_close(a.grad, torch.full((3,), 6.0))
