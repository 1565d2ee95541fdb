"""stratagem.launch: N replicas from `python -c` and a notebook kernel, rank 0's result back,
a failing rank's traceback back, a hard timeout, and replicas that die with their caller."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

TRAIN = textwrap.dedent(
    """
    import os, torch, stratagem as sg

    def train(scale):
        strategy = sg.MirroredStrategy("cpu", num_replicas=2)
        rank = int(os.environ["RANK"])
        value = strategy.run(lambda: torch.tensor([rank + scale]))
        total = strategy.reduce(sg.ReduceOp.SUM, value, axis=None)
        print(f"replica {rank} launcher={os.environ['STRATAGEM_LAUNCHER']}")
        return float(total), strategy.num_replicas_in_sync, rank

    def quick():  # returns as soon as the group is formed: rank 0 (the store) must not leave early
        return sg.MirroredStrategy("cpu", num_replicas=2).num_replicas_in_sync

    def fail_on_one():
        strategy = sg.MirroredStrategy("cpu", num_replicas=2)
        if int(os.environ["RANK"]) == 1:
            raise ValueError("boom on replica 1")
        return strategy.reduce(sg.ReduceOp.SUM, strategy.run(lambda: torch.ones(1)), axis=None)
    """
)


def _python_c(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_launch_from_python_c_returns_rank_0_result_and_reports_a_failing_rank():
    code = TRAIN + textwrap.dedent(
        """
        print("RESULT", sg.launch(train, 1.0, num_replicas=2, timeout=40))
        print("QUICK", sg.launch(quick, num_replicas=2, timeout=40))
        try:
            sg.launch(fail_on_one, num_replicas=2, timeout=40)
        except sg.LaunchError as e:
            print("FAILED rank", e.rank)
            print(e)
        """
    )
    r = _python_c(code, timeout=55)
    assert r.returncode == 0, r.stderr
    # 1 + 2 summed over the replicas; MirroredStrategy joined the launched job, nothing re-ran
    assert "RESULT (3.0, 2, 0)" in r.stdout
    assert "QUICK 2" in r.stdout
    assert "replica 0 launcher=launch" in r.stdout and "replica 1 launcher=launch" in r.stdout
    assert "FAILED rank 1" in r.stdout
    assert "ValueError: boom on replica 1" in r.stdout
    assert "in fail_on_one" in r.stdout  # the rank's own traceback, from its own frame


@pytest.mark.timeout(30)
def test_launch_timeout_kills_the_replicas_and_the_replicas_die_with_their_caller(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, time, stratagem as sg

        def stuck(path):
            open(os.path.join(path, str(os.getpid())), "w").close()
            time.sleep(120)

        start = time.monotonic()
        try:
            sg.launch(stuck, {str(tmp_path)!r}, num_replicas=2, timeout=2)
        except sg.LaunchTimeoutError as e:
            print("TIMEOUT", round(time.monotonic() - start), e.rank)
        sg.launch(stuck, {str(tmp_path / "orphans")!r}, num_replicas=2)  # killed below
        """
    )
    (tmp_path / "orphans").mkdir()
    # the killed caller cannot remove its launch folder (the payload): keep it in this test's own
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 20
    while len(os.listdir(tmp_path / "orphans")) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(n) for n in os.listdir(tmp_path / "orphans")]
    assert len(pids) == 2
    p.kill()  # the caller dies without cleaning up: its replicas must go too
    out, _ = p.communicate(timeout=10)
    assert "TIMEOUT" in out and int(out.split()[1]) < 8
    first = [int(n) for n in os.listdir(tmp_path) if n.isdigit()]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids + first):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids + first)
    assert [n.name.startswith("stratagem-launch-") for n in (tmp_path / "tmp").iterdir()] == [True]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_launch_from_a_notebook_kernel():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(TRAIN),
        nbformat.v4.new_code_cell("result = sg.launch(train, 1.0, num_replicas=2, timeout=60)\nprint('RESULT', result)"),
    ]
    client = nbclient.NotebookClient(nb, timeout=80, kernel_name="python3", startup_timeout=40)
    client.execute()
    outputs = [
        "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
        for cell in nb.cells
    ]
    assert "RESULT (3.0, 2, 0)" in outputs[1]
    assert "replica 1 launcher=launch" in outputs[1]  # the replicas' output reaches the cell


def test_without_cloudpickle_a_main_function_is_refused_before_anything_starts(monkeypatch):
    import stratagem as sg

    monkeypatch.setitem(sys.modules, "cloudpickle", None)

    def fn():
        return 1

    fn.__module__ = "__main__"
    with pytest.raises(TypeError, match="pip install cloudpickle"):
        sg.launch(fn, num_replicas=2)
