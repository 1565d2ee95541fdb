"""Jobs formed across hosts of their own (``stratagem.testing.hosts``), with nothing set but what
the docs show: no GLOO_SOCKET_IFNAME, no --bind. This machine's hostname resolves to a loopback
address (as on stock Debian/Ubuntu), the case where gloo left to itself tells its peers to
connect to their own loopback. Needs root and `ip`; skipped otherwise."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.testing import hosts as hosts_mod
from stratagem.testing.hosts import Hosts, job_env

pytestmark = pytest.mark.skipif(bool(hosts_mod.unavailable()), reason=hosts_mod.unavailable() or "-")

REPO = Path(__file__).resolve().parent.parent.parent
MW_SCRIPT = REPO / "tests" / "multiworker" / "mw_script.py"
LINE = re.compile(r"rank=(\d) world=2 worker=(\d) digest=([0-9a-f]{16})")


def _env(**extra: str) -> dict[str, str]:
    return job_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"), **extra)


def _finish(procs, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    return outs


def _same_model(outs: list[str], procs) -> None:
    report = "\n=====\n".join(o[-3000:] for o in outs)
    assert [p.returncode for p in procs] == [0, 0], report
    found = [LINE.search(o) for o in outs]
    assert all(found), report
    assert sorted(m.group(1) for m in found) == ["0", "1"]  # type: ignore[union-attr]
    assert found[0].group(3) == found[1].group(3), report  # type: ignore[union-attr]


@pytest.mark.timeout(150)
@pytest.mark.slow
def test_tf_config_multi_worker_forms_and_trains_across_two_hosts():
    """The docs' TF_CONFIG program, one worker per host, nothing else set."""
    with Hosts(2) as hosts:
        workers = [f"{h.address}:2222" for h in hosts]
        procs = []
        for i, h in enumerate(hosts):
            tf_config = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
            procs.append(h.popen([sys.executable, str(MW_SCRIPT)], env=_env(TF_CONFIG=tf_config), cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        _same_model(_finish(procs, 120), procs)


@pytest.mark.slow  # the TF_CONFIG case above stays in the main tier
@pytest.mark.timeout(150)
def test_stratagem_run_forms_across_two_hosts_without_bind():
    """`stratagem run --nnodes 2 --node-rank R --rdzv-endpoint` as docs/MULTIWORKER.md shows it."""
    with Hosts(2) as hosts:
        endpoint = f"{hosts[0].address}:29400"
        procs = []
        for i, h in enumerate(hosts):
            cmd = [sys.executable, "-m", "stratagem", "run", "-n", "1", "--nnodes", "2", "--node-rank", str(i),
                   "--rdzv-endpoint", endpoint, str(MW_SCRIPT)]
            procs.append(h.popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True))
        _same_model(_finish(procs, 120), procs)


@pytest.mark.timeout(90)
def test_a_task_address_no_interface_holds_is_a_clear_error():
    """TF_CONFIG naming, for this task, an address this host does not have (a copy-paste of the
    other task's entry): one line naming the address and what to fix, not a gloo timeout."""
    with Hosts(2) as hosts:
        a, b = hosts
        workers = [f"{a.address}:2222", f"{a.address}:2223"]  # worker 1 is on host b, not a
        tf_config = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": 1}})
        r = b.run([sys.executable, str(MW_SCRIPT)], env=_env(TF_CONFIG=tf_config), cwd=REPO,
                  capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert f"the cluster names {a.address} as this task's address" in r.stderr, r.stderr
        assert "TF_CONFIG" in r.stderr


def _run_on_each(hosts, script: Path, timeout: float = 120) -> tuple[list[str], list]:
    """`stratagem run -n 1 --nnodes N --node-rank R --rdzv-endpoint H0:PORT script` on each host."""
    endpoint = f"{hosts[0].address}:29400"
    procs = [h.popen([sys.executable, "-m", "stratagem", "run", "-n", "1", "--nnodes", str(len(hosts)),
                      "--node-rank", str(i), "--rdzv-endpoint", endpoint, str(script)],
                     env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i, h in enumerate(hosts)]
    return _finish(procs, timeout), procs


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_pipeline_stages_on_two_hosts_train():
    """PipelineStrategy's two stages on two hosts (the user's script, under `stratagem run`)."""
    with Hosts(2) as hosts:
        outs, procs = _run_on_each(hosts, REPO / "tests" / "pipeline" / "pipeline_script.py")
        report = "\n=====\n".join(o[-2000:] for o in outs)
        assert [p.returncode for p in procs] == [0, 0], report
        found = [re.search(r"stage (\d): loss ([\d.]+) -> ([\d.]+), accuracy ([\d.]+)", o) for o in outs]
        assert all(found), report
        assert sorted(m.group(1) for m in found) == ["0", "1"]  # type: ignore[union-attr]
        first, last, acc = (float(found[0].group(i)) for i in (2, 3, 4))  # type: ignore[union-attr]
        assert last < 0.5 * first and acc > 0.9, report
        assert found[0].groups()[1:] == found[1].groups()[1:], report  # both stages report the same


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sharded_over_two_hosts_equals_one_process():
    with Hosts(2) as hosts:
        outs, procs = _run_on_each(hosts, Path(__file__).with_name("sharded_job.py"))
        report = "\n=====\n".join(o[-2000:] for o in outs)
        assert [p.returncode for p in procs] == [0, 0], report
        diffs = [re.search(r"sharded rank \d of 2: max difference from one process (\S+)", o) for o in outs]
        assert all(diffs), report
        assert all(float(m.group(1)) < 1e-5 for m in diffs), report  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_parameter_server_tutorial_with_chief_workers_and_ps_on_four_hosts(tmp_path):
    """TensorFlow's parameter-server tutorial (the port), every task on a host of its own, each
    started with its TF_CONFIG as the tutorial's text says: rpc (TensorPipe) and gloo pinned to
    the interface holding the task's address."""
    pytest.importorskip("cloudpickle")
    with Hosts(4) as hosts:
        cluster = {"chief": [f"{hosts[0].address}:2222"],
                   "worker": [f"{hosts[1].address}:2222", f"{hosts[2].address}:2222"],
                   "ps": [f"{hosts[3].address}:2222"]}
        tasks = [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]
        script = REPO / "examples" / "tutorials" / "parameter_server_training.py"
        procs = []
        for (kind, index), h in zip(tasks, hosts):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})
            procs.append(h.popen([sys.executable, str(script)], env=_env(TF_CONFIG=tf_config),
                                 cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True))
        outs = _finish(procs, 180)
        report = "\n=====\n".join(o[-2000:] for o in outs)
        assert [p.returncode for p in procs] == [0, 0, 0, 0], report
        assert float(re.search(r"Evaluation accuracy: ([\d.]+)", outs[0]).group(1)) > 0.9, report  # type: ignore[union-attr]
        for o in outs:
            assert "Traceback" not in o and "[W" not in o, report
