"""The strategy belongs to what it created; fit reads only its own shard; few collectives per step."""

from __future__ import annotations

import pytest
import torch
from house_workers import (
    collectives_worker,
    readme_fit_reference,
    readme_fit_worker,
    sharded_fit_reference,
    sharded_fit_worker,
)

from stratagem.testing import run_workers


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.timeout(180)
def test_readme_fit_call_shape_matches_one_device_and_mismatches_raise_everywhere():
    ref = readme_fit_reference()
    for r in run_workers(readme_fit_worker, 2, timeout=150):
        v = r.value
        _same(v["params"], ref["params"])  # was exactly 2x the update before the model carried its strategy
        for k in ref["history"]:
            assert v["history"][k] == pytest.approx(ref["history"][k], rel=1e-5), k
        assert v["owner_is_strategy"]
        assert v["explicit_other"].startswith("StrategyMismatchError") and "MirroredStrategy" in v["explicit_other"]
        assert v["open_other_scope"].startswith("StrategyMismatchError")
        assert v["plain_under_mirrored"].startswith("OutsideScopeError")
        assert v["checkpoint_other"].startswith("StrategyMismatchError")
        assert "outside strategy.run" in v["backward_outside_run"]


@pytest.mark.timeout(180)
def test_fit_reads_only_its_own_shard_and_matches_one_device():
    ref = sharded_fit_reference()
    results = run_workers(sharded_fit_worker, 2, timeout=150)
    # 44 elements over 2 replicas: each replica's pipeline maps its own 22, never the other 22
    assert [r.value["fit_map_calls"] for r in results] == [22, 22]  # 5 x 4 + 2 each (last batch of 4 split 2/2)
    assert sum(r.value["evaluate_map_calls"] for r in results) == 44
    assert sum(r.value["predict_map_calls"] for r in results) == 44
    for r in results:
        _same(r.value["params"], ref["params"])
        torch.testing.assert_close(r.value["predict"], ref["predict"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(180)
def test_collectives_per_step():
    r = run_workers(collectives_worker, 2, timeout=150)[0].value
    steady = r["loop"][1:]  # the first step also checks the first global batch and each call site
    for counts in steady:
        small = {k: v for k, v in counts.items() if k != "all_reduce_async"}
        # the input vote, compute_average_loss's global count, the reduce of the loss: one each
        assert small == {"all_reduce_": 3}, counts
        assert counts.get("all_reduce_async", 0) == 1  # one gradient bucket for this small model
    for counts in r["fit"][1:]:
        small = {k: v for k, v in counts.items() if k != "all_reduce_async"}
        # the input vote, the global count, the metric totals
        assert small == {"all_reduce_": 3}, counts
    # a callback whose batch hook may stop training: every replica agrees after each batch whether
    # to stop (one more small all-reduce; its first call also checks its call site)
    for counts in r["may_stop"][2:]:
        small = {k: v for k, v in counts.items() if k != "all_reduce_async"}
        assert small == {"all_reduce_": 4}, counts
    # steps_per_execution=4: the input vote, the global counts and the metric totals once per
    # execution of 4 steps (the gradient buckets once per step)
    assert len(r["executions"]) == 2, r["executions"]
    for counts in r["executions"][1:]:
        assert counts == {"all_reduce_": 3, "all_reduce_async": 4}, counts


@pytest.mark.timeout(240)
def test_mixed_precision_and_steps_per_execution_match_one_device():
    from house_workers import precision_reference, precision_worker

    ref = precision_reference()
    for r in run_workers(precision_worker, 2, timeout=200):
        v = r.value
        for p, tol in (("bf16", 3e-2), ("fp16", 3e-3)):  # the tolerance each precision allows
            for k in ref[p]["params"]:
                torch.testing.assert_close(v[p]["params"][k], ref[p]["params"][k], rtol=tol, atol=tol, msg=f"{p} {k}")
            assert v[p]["history"]["loss"] == pytest.approx(ref[p]["history"]["loss"], rel=tol)
        # bf16 really computed in bf16: it differs from fp32 by more than fp32 rounding
        assert any(not torch.allclose(v["bf16"]["params"][k], ref["32"]["params"][k], rtol=1e-6, atol=1e-7)
                   for k in ref["32"]["params"])
        # steps_per_execution=3: logs read every 3 steps, same training and same epoch logs
        _same(v["spe3"]["params"], ref["32"]["params"])
        assert v["spe3"]["history"]["loss"] == pytest.approx(ref["32"]["history"]["loss"], rel=1e-5)
        c = v["custom"]
        assert c["fp16_forward"] == [1.0] * 4  # RunOptions(precision="fp16") autocasts the step
        assert c["encoded"] == ["model", "scaler"] and c["scale"] > 0
