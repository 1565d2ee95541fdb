"""The Strategy API in one process: default strategy, contexts, InputContext, plans, losses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.comm.buckets import MB, ParamSpec, describe, plan_buckets
from stratagem.core import tree
from stratagem.core.batches import split_sizes


def test_default_strategy_outside_any_scope():
    s = sg.get_strategy()
    assert not sg.has_strategy()
    assert s.num_replicas_in_sync == 1
    assert s.run(lambda a, b=0: a + b, args=(1,), kwargs={"b": 2}) == 3
    v = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(s.reduce(sg.ReduceOp.SUM, v), v)
    assert s.reduce("mean", v, axis=0).item() == 2.0
    ctx = sg.get_replica_context()
    assert ctx is not None and ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1
    assert ctx.all_reduce("sum", torch.tensor(5)).item() == 5


def test_scope_sets_and_restores_the_current_strategy():
    s = sg.OneDeviceStrategy("cpu")
    with s.scope():
        assert sg.has_strategy() and sg.get_strategy() is s
        assert sg.get_replica_context() is None  # cross-replica context
        assert sg.in_cross_replica_context()
        with s.scope():  # re-entering the same strategy is fine
            assert sg.get_strategy() is s
        with pytest.raises(RuntimeError, match="inside the scope of OneDeviceStrategy"):
            with sg.OneDeviceStrategy("cpu").scope():
                pass
    assert not sg.has_strategy()
    inside = s.run(lambda: sg.get_replica_context())
    assert inside.replica_id_in_sync_group == 0 and inside.strategy is s


@pytest.mark.parametrize(
    "global_batch, replicas, per_replica",
    [(64, 2, 32), (64, 4, 16), (6, 3, 2), (7, 1, 7)],
)
def test_input_context_per_replica_batch(global_batch, replicas, per_replica):
    ctx = sg.InputContext(1, 0, replicas)
    assert ctx.get_per_replica_batch_size(global_batch) == per_replica


def test_input_context_indivisible_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="global batch size 10 is not divisible by 4 replicas; use a multiple of 4"):
        sg.InputContext(1, 0, 4).get_per_replica_batch_size(10)


@pytest.mark.parametrize(
    "batch, replicas, sizes",
    [(4, 2, [2, 2]), (2, 2, [1, 1]), (4, 5, [1, 1, 1, 1, 0]), (6, 4, [2, 2, 1, 1]), (3, 2, [2, 1]), (0, 2, [0, 0])],
)
def test_split_sizes_follow_tf_rebatching(batch, replicas, sizes):
    assert split_sizes(batch, replicas) == sizes


def test_bucket_plan_is_reverse_registration_order_with_a_small_first_bucket():
    specs = [ParamSpec(f"p{i}", n, 4, "float32", "cpu") for i, n in enumerate([10, MB // 4, MB // 4, 10])]
    plan = plan_buckets(specs, first_cap=MB, cap=2 * MB)
    assert [b.params for b in plan] == [(3, 2), (1, 0)]
    assert describe(plan) == f"B0[2p {MB // 4 + 10} float32] B1[2p {MB // 4 + 10} float32]"
    mixed = [ParamSpec("a", 4, 4, "float32", "cpu"), ParamSpec("b", 4, 2, "float16", "cpu")]
    assert sorted(b.dtype for b in plan_buckets(mixed)) == ["float16", "float32"]
    # an order seen in a backward pass (a tied weight registered last, ready last)
    assert [b.params for b in plan_buckets(specs, first_cap=MB, cap=2 * MB, order=[2, 1, 0, 3])] == [(2,), (1, 0, 3)]
    with pytest.raises(ValueError, match="each of the 4 parameters once"):
        plan_buckets(specs, order=[0, 1, 1, 3])


def test_nest_roundtrip_and_signature():
    value = {"x": (torch.zeros(2, 3), [torch.ones(1)]), "n": 3}
    leaves, spec = tree.flatten(value)
    assert len(leaves) == 3
    assert tree.unflatten(spec, leaves)["x"][1][0].shape == (1,)
    assert tree.signature(value) == "{'x': (float32[2,3], [float32[1]]), 'n': int}"


def test_map_structure_equals_pytree_and_calls_fn_once_per_leaf():
    import collections

    from torch.utils import _pytree as pytree

    pair = collections.namedtuple("pair", "x y")
    values = [
        torch.ones(2),
        (torch.ones(2), [torch.zeros(1), 3]),
        {"b": (torch.ones(1),), "a": pair(torch.ones(2), [torch.zeros(1), "s"])},  # a leaf first
        {"a": torch.ones(1), "b": collections.OrderedDict(c=torch.ones(2))},  # pytree's own node
    ]
    seen: list[object] = []

    def double(t):
        seen.append(t)
        return t * 2 if isinstance(t, torch.Tensor) else t

    for value in values:
        seen.clear()
        got = tree.map_structure(double, value)
        want = pytree.tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) else t, value)
        assert pytree.tree_structure(got) == pytree.tree_structure(want)
        for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        if not isinstance(value, dict) or not isinstance(value["b"], collections.OrderedDict):
            assert len(seen) == len(pytree.tree_leaves(value))  # plain and named tuples: once each


def test_compute_average_loss_divides_by_the_global_batch():
    per_example = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert sg.compute_average_loss(per_example).item() == 3.0
    assert sg.compute_average_loss(per_example, global_batch_size=8).item() == 1.5
    weighted = sg.compute_average_loss(per_example, global_batch_size=4, sample_weight=torch.tensor([1.0, 1, 0, 0]))
    assert weighted.item() == 0.75
    with pytest.raises(ValueError, match="reduction='none'"):
        sg.compute_average_loss(per_example.mean())


def test_one_device_strategy_places_and_refuses_foreign_modules():
    s = sg.OneDeviceStrategy("cpu")
    with s.scope():
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = s.run(lambda x: model(x).sum(), args=(torch.ones(4, 3),))
    out.backward()
    opt.step()
    foreign = nn.Linear(3, 2)
    with pytest.raises(sg.OutsideScopeError, match=r"Linear \(parameter 'weight', shape \(2, 3\)\) was created outside"):
        s.run(foreign, args=(torch.ones(1, 3),))
    with pytest.raises(ValueError, match="CUDA is not available") if not torch.cuda.is_available() else _noop():
        sg.OneDeviceStrategy("cuda:0")


class _noop:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_function_compiles_and_matches_eager():
    torch.manual_seed(0)
    s = sg.OneDeviceStrategy("cpu")
    with s.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(16, 4)

    def forward(x):
        return model(x).square().mean()

    compiled = sg.function(forward, jit_compile=True, backend="aot_eager")
    assert torch.allclose(s.run(forward, args=(x,)), s.run(compiled, args=(x,)), atol=1e-6)
    assert "forward" in repr(compiled)


def test_reduce_op_parsing():
    assert sg.ReduceOp.of("SUM") is sg.ReduceOp.SUM
    with pytest.raises(ValueError, match="use stratagem.ReduceOp.SUM or MEAN"):
        sg.ReduceOp.of("median")
