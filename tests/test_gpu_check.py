"""scripts/gpu_check.sh without a GPU: its skip path, its dry run, and the summary it builds."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEP_NAMES = ["suite", "pytest-gpu", "demo", "quickstart", "bench-fit-onedevice", "bench-image-feed",
              "bench-nanogpt-fit", "bench-sharded", "bench-mirrored"]


def _summary():
    spec = importlib.util.spec_from_file_location("gpu_check_summary", ROOT / "scripts" / "gpu_check_summary.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    full = {**base, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full,
                          timeout=120, cwd=ROOT)


def test_no_cuda_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.md"
    r = _run("--out", str(out))  # CUDA_VISIBLE_DEVICES="" hides any GPU
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == ""
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], r.stdout
    assert not out.exists()  # nothing run, nothing written


def test_dry_run_lists_every_step_and_writes_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "check.md"
    r = _run("--dry-run", "--out", str(out), TMPDIR=str(tmp_path))  # its logs' folder stays: here, not in /tmp
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""
    table = out.read_text()
    for name in STEP_NAMES:
        assert f"| {name} | skipped |" in table
    assert f"{len(STEP_NAMES)} skipped" in table and "0 passed, 0 failed" in table
    assert "not measured | >= 0.97" in table  # fit vs the plain loop, with its target
    assert table in r.stdout  # printed too
    # the steps are listed in the order
    positions = [r.stdout.index(f"== {name}:") for name in STEP_NAMES]
    assert positions == sorted(positions)
    assert [p.name.startswith("gpu_check.") for p in tmp_path.iterdir() if p.is_dir()] == [True]


def test_unknown_argument_is_a_clear_error() -> None:
    r = _run("--gpus", "2")
    assert r.returncode == 64
    assert "unknown argument '--gpus'" in r.stderr


def _write_steps(tmp_path: Path, rows: list[tuple[str, str, int, str]]) -> Path:
    steps = tmp_path / "steps.tsv"
    lines = []
    for name, status, rc, log_text in rows:
        log = tmp_path / f"{name}.log"
        log.write_text(log_text)
        lines.append(f"{name}\t{status}\t{rc}\t12\t{log}")
    steps.write_text("\n".join(lines) + "\n")
    return steps


def test_summary_from_passed_failed_timed_out_and_skipped_steps(tmp_path: Path) -> None:
    mod = _summary()
    steps = _write_steps(tmp_path, [
        ("suite", "passed", 0, "512 passed in 200s\n"),
        ("pytest-gpu", "failed", 1, "FAILED tests/test_gpu.py::test_bf16 - AssertionError: 0.5 != 0.25\n"),
        ("demo", "skipped", 0, "scikit-learn is not installed\n"),
        ("bench-fit-onedevice", "passed", 0,
         "fit / plain 0.981x\nRESULT fit_vs_plain=0.9810\nRESULT onedevice_vs_plain=0.9500\n"),
        ("bench-image-feed", "timeout", 124, "warming up\ntimed out after 240s\n"),
    ])
    out = tmp_path / "gpu_check.md"
    assert mod.main([str(steps), "--out", str(out), "--machine", "1 x NVIDIA H100, torch 2.11, 16 cores"]) == 0
    table = out.read_text()
    assert "Machine: 1 x NVIDIA H100, torch 2.11, 16 cores" in table
    assert "| suite | passed | 12 |" in table
    assert "| pytest-gpu | **FAILED** (exit 1) | 12 | FAILED tests/test_gpu.py::test_bf16" in table
    assert "| demo | skipped | 12 | scikit-learn is not installed |" in table
    assert "| bench-image-feed | **TIMEOUT** (exit 124) | 12 | timed out after 240s |" in table
    assert "(`fit_vs_plain`) | 0.981 | >= 0.97 | met | bench-fit-onedevice |" in table
    assert "(`onedevice_vs_plain`) | 0.950 | >= 0.98 | NOT met | bench-fit-onedevice |" in table
    assert "(`feed_vs_dataloader`) | not measured | >= 1 |" in table
    assert "Steps: 2 passed, 2 failed, 1 skipped (failed: pytest-gpu, bench-image-feed)" in table


def test_summary_parses_what_the_benchmarks_print() -> None:
    mod = _summary()
    text = "plain torch loop  2209.4 steps/s\nRESULT fit_vs_plain=0.9388\n  RESULT mirrored_vs_ddp=1.02 \n"
    assert mod.parse_results(text) == {"fit_vs_plain": 0.9388, "mirrored_vs_ddp": 1.02}
    assert mod.parse_results("ratio stratagem / DDP: 0.980\n") == {}


def test_summary_rejects_a_malformed_steps_file(tmp_path: Path) -> None:
    mod = _summary()
    bad = tmp_path / "steps.tsv"
    bad.write_text("suite\tgreen\t0\t1\t/nonexistent\n")
    with pytest.raises(ValueError, match="status in"):
        mod.read_steps(bad)
