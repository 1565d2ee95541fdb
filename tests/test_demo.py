"""The main job, as the README runs it: fit on 2 replicas, printed once, plot written."""

from __future__ import annotations

import pytest

from stratagem.testing import assert_clean_run, run_script


# in the slow tier (10-20 s; CI runs it): the main tier stays under 15 minutes
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_trains_to_high_accuracy_and_prints_once(tmp_path):
    plot = tmp_path / "history.png"
    r = run_script(["-m", "stratagem", "demo", "--epochs", "6", "--plot", str(plot)], timeout=170)
    assert_clean_run(r, what="stratagem demo")
    assert r.stdout.count("final held-out accuracy") == 1
    assert r.stdout.count("Epoch 6/6") == 1
    assert float(r.stdout.split("final held-out accuracy")[1].split()[0]) > 0.95
    assert plot.stat().st_size > 0


# in the slow tier (10-20 s; CI runs it): the main tier stays under 15 minutes
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_custom_loop_demo(tmp_path):
    r = run_script(["-m", "stratagem", "demo", "--custom-loop", "--epochs", "6"], timeout=170, cwd=str(tmp_path))
    assert_clean_run(r, what="stratagem demo --custom-loop")
    assert r.stdout.count("epoch  6/6") == 1
