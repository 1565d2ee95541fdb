"""The five TensorFlow tutorials of examples/tutorials run as written, on small data made in code."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from stratagem.testing import assert_clean_run, run_script

TUTORIALS = Path(__file__).resolve().parents[1] / "examples" / "tutorials"


def _run(name: str, tmp_path: Path, timeout: float, launcher: tuple[str, ...] = ()):
    env = {**os.environ, "CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    env.pop("TF_CONFIG", None)
    r = run_script([*launcher, str(TUTORIALS / name)], timeout=timeout, env=env)
    assert_clean_run(r, what=name)
    return r.stdout


@pytest.mark.timeout(90)
def test_custom_training_loop_tutorial(tmp_path):
    out = _run("custom_training.py", tmp_path, 80)
    epochs = re.findall(r"Epoch (\d), Loss: [\d.]+, Accuracy: [\d.]+, Test Loss: [\d.]+, Test Accuracy: ([\d.]+)", out)
    assert [e for e, _ in epochs] == ["1", "2", "3", "4"], out  # printed once, by the chief
    assert float(epochs[-1][1]) > 80, out  # it learns (the label is the brightest quadrant)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-0", "ckpt-2"]


@pytest.mark.timeout(90)
def test_keras_distributed_training_tutorial(tmp_path):
    out = _run("keras_distributed.py", tmp_path, 80)
    lrs = re.findall(r"Learning rate for epoch (\d) is ([\de.-]+)", out)
    assert [(e, float(lr)) for e, lr in lrs] == [("1", 1e-3), ("2", 1e-3), ("3", 1e-3), ("4", 1e-4)], out
    acc = re.search(r"Eval loss: [\d.]+, Eval accuracy: ([\d.]+)", out)
    assert acc is not None and float(acc.group(1)) > 0.8, out
    assert (tmp_path / "ckpt" / "training.csv").read_text().count("\n") == 5  # header + 4 epochs


@pytest.mark.timeout(90)
def test_multi_worker_tf_config_tutorial(tmp_path):
    out = _run("multi_worker_tf_config.py", tmp_path, 80)  # starts 2 workers, each with TF_CONFIG
    m = re.findall(r"workers=(\d) accuracy=([\d.]+)", out)
    assert len(m) == 1 and m[0][0] == "2" and float(m[0][1]) > 0.8, out


@pytest.mark.timeout(60)
def test_data_performance_guide(tmp_path):
    out = _run("data_performance.py", tmp_path, 50)
    speedups = dict(re.findall(r"(\w[\w ]*?) ([\d.]+)x", out.splitlines()[-1]))
    assert set(speedups) == {"prefetch", "parallel interleave", "parallel map", "cache", "vectorized map"}, out
    # the techniques whose gain does not depend on idle cores: reading a cache, one call per batch
    assert float(speedups["cache"]) > 1.5 and float(speedups["vectorized map"]) > 2, out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_parameter_server_training_tutorial(tmp_path):
    pytest.importorskip("cloudpickle")
    # as its docstring says: a chief, 2 workers and 1 ps task on this machine
    launcher = ("-m", "stratagem", "run", "--workers", "2", "--ps", "1")
    out = _run("parameter_server_training.py", tmp_path, 80, launcher)
    fit_losses = [float(v) for v in re.search(r"fit: loss per epoch (.*)", out).group(1).split(", ")]
    assert len(fit_losses) == 5 and fit_losses[-1] < 0.1 * fit_losses[0], out
    epochs = re.findall(r"Finished epoch (\d), accuracy is ([\d.]+)\.", out)
    assert [e for e, _ in epochs] == ["0", "1", "2", "3"] and float(epochs[-1][1]) > 0.9, out
    assert float(re.search(r"Final loss is ([\d.]+)", out).group(1)) < 0.3, out
    assert float(re.search(r"Evaluation accuracy: ([\d.]+)", out).group(1)) > 0.9, out
    assert "ckpt-5" in os.listdir(tmp_path / "ckpt" / "ckpt")  # ModelCheckpoint, written by the chief
