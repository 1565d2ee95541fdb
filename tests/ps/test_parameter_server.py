"""ParameterServerStrategy on a local cluster (`stratagem run --workers N --ps P`): one worker
equals one process at 1e-5, two workers converge, a killed worker's functions run elsewhere and
every result is delivered once, a lost ps is a clear error, checkpoints are portable; the
placement plan is tested with ==. The job itself is tests/ps/ps_train.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from stratagem.distribute.engines.ps_plan import Shard, VariablePlan, plan_variables
from stratagem.partitioners import FixedShardsPartitioner, MinSizePartitioner
from stratagem.testing import run_script
from stratagem.testing.output import assert_clean_run, stratagem_lines, tracebacks

pytest.importorskip("cloudpickle")
SCRIPT = str(Path(__file__).parent / "ps_train.py")
#: a line torch's C++ side logs (e.g. rref_context.cpp waiting for references a dead task held)
TORCH_LOG = re.compile(r"^\[[EWF]\d{4} ", re.M)


def job(workers: int, ps: int, *args: str, timeout: float = 120):
    argv = ["-m", "stratagem", "run", "--workers", str(workers), "--ps", str(ps), "--grace-period", "20", SCRIPT, *args]
    return run_script(argv, timeout=timeout)


def result(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("RESULT"))


# --- the cluster ----------------------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("optimizer", "ps"), [
    ("sgd", 2),
    # the other optimizers' ps-side state, in the slow tier (10-15 s each): the main one under 15 minutes
    pytest.param("adagrad", 1, marks=pytest.mark.slow),
    pytest.param("sgd_steplr", 1, marks=pytest.mark.slow),
])
def test_one_worker_equals_one_process(optimizer, ps):
    """The embedding table is split over the ps tasks (FixedShardsPartitioner(2)) and read row by
    row; the MLP's variables are whole, round-robin over the tasks."""
    r = job(1, ps, "parity", optimizer)
    assert_clean_run(r, what="a one-worker parameter-server job")
    assert "RESULT param_diff=" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_workers_converge_like_one_process():
    r = job(2, 1, "converge", "sgd")
    assert_clean_run(r, what="a two-worker parameter-server job")
    start, trained, ref = (float(x) for x in re.findall(r"=([\d.]+)", result(r.stdout)))
    assert trained < 0.5 * start and trained < 1.5 * ref + 0.05


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_worker_s_functions_run_on_the_other_and_each_result_arrives_once():
    r = job(2, 1, "kill")
    assert r.returncode == 0, r.stderr
    assert result(r.stdout) == "RESULT lost=['worker:1'] delivered=24"
    lines = sorted(stratagem_lines(r.stderr), key=lambda line: line.startswith("stratagem run"))
    assert len(lines) == 2, r.stderr  # the chief's and the launcher's, in either order
    # the transport's words for a closed connection vary (eof, pipe closed, connection reset)
    assert re.fullmatch(r"stratagem: worker:1 failed \(.+\); its functions run on the other workers", lines[0])
    assert lines[1] == (
        "stratagem run: worker 1 failed (exit code 7); not restarting it (0 of 0 restarts used), "
        "the job goes on without it"
    )
    assert tracebacks(r.stderr) == 0 and not TORCH_LOG.search(r.stderr), r.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["rejoin", "rejoin_idle"])
def test_a_restarted_worker_rejoins_and_runs_functions_again(mode):
    """Worker 1 dies in its third function (rejoin_idle: while it has nothing to run); the launcher
    starts it again (--max-restarts 1); the chief takes it back into the rpc group under a new rank,
    rebuilds its per-worker dataset there and sends it functions again; every result is still
    delivered once."""
    argv = ["-m", "stratagem", "run", "--workers", "2", "--ps", "2", "--max-restarts", "1", "--grace-period", "20", SCRIPT, mode]
    r = run_script(argv, timeout=150)
    assert r.returncode == 0, r.stderr
    assert result(r.stdout) == "RESULT lost=['worker:1'] ran_on=['0.0', '1.0', '1.1'] back=True", r.stderr
    lines = stratagem_lines(r.stderr)
    assert len(lines) == 3, r.stderr
    assert re.fullmatch(r"stratagem: worker:1 failed \(.+\); its functions run on the other workers", lines[0]) or re.fullmatch(
        r"stratagem: worker:1 failed \(.+\); its functions run on the other workers", lines[1]
    ), r.stderr
    assert "stratagem run: worker 1 failed (exit code 7); restarting it (1 of 1)" in lines
    assert lines[-1] == "stratagem: worker:1 restarted and rejoined; it runs functions again"
    assert tracebacks(r.stderr) == 0 and not TORCH_LOG.search(r.stderr), r.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_when_every_worker_is_lost_the_chief_waits_for_restarted_ones():
    """Both workers die in their second function: with restarts (--max-restarts 1) the chief
    waits for them instead of failing, takes them back, and every result arrives once."""
    argv = ["-m", "stratagem", "run", "--workers", "2", "--ps", "1", "--max-restarts", "1", "--grace-period", "20", SCRIPT, "all_lost"]
    r = run_script(argv, timeout=150)
    assert r.returncode == 0, r.stderr
    lost, ran, back = re.fullmatch(r"RESULT lost=(.+) ran_on=(.+) back=(\w+)", result(r.stdout)).groups()
    assert lost == "['worker:0', 'worker:1']" and back == "True", r.stdout
    assert {"'0.0'", "'1.0'", "'1.1'"} <= set(ran.strip("[]").split(", ")), ran
    lines = stratagem_lines(r.stderr)
    assert "stratagem: every worker is lost; waiting up to 120s for one to be restarted" in lines, r.stderr
    assert sum(line.endswith("restarted and rejoined; it runs functions again") for line in lines) >= 1, r.stderr
    assert tracebacks(r.stderr) == 0 and not TORCH_LOG.search(r.stderr), r.stderr


@pytest.mark.slow  # with the other lost-worker cases, in the slow tier (CI runs it): the main tier under 15 minutes
@pytest.mark.timeout(180)
def test_when_every_worker_is_lost_without_restarts_the_fetch_under_way_raises():
    """Both workers die in their second function and nothing restarts them: the chief's fetch of
    the function under way when the last one died raises WorkerLostError (the function was put
    back for the other workers just as none was left: it must not wait for one forever)."""
    r = job(2, 1, "all_lost_fetch", timeout=90)
    line = result(r.stdout)
    assert re.fullmatch(
        r"RESULT raised_after=[\d.]+ lost=\['worker:0', 'worker:1'\] every worker is lost \(worker:\d, worker:\d\); "
        r"the scheduled functions cannot run: restart the job and restore the last checkpoint",
        line,
    ), r.stdout + r.stderr
    assert tracebacks(r.stderr) == 0 and not TORCH_LOG.search(r.stderr), r.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_lost_ps_is_a_clear_error_naming_the_checkpoint(tmp_path):
    r = job(2, 1, "ps_lost", "sgd", str(tmp_path))
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()
    error = next(line for line in last if line.startswith("stratagem.distribute.engines.ps_client.ParameterServerError"))
    # its rpc failed, or the cluster watch saw its process gone first: either names it
    assert re.search(r"could not reach parameter server ps:0|parameter server ps:0 \(.+\) failed: its process "
                     r"\(pid \d+\) is gone", error), error
    assert "the variables it holds are lost" in error, error
    assert f"the last checkpoint this job saved: {tmp_path}" in error
    assert "stratagem run: ps 0 failed (exit code 9)" in last
    assert tracebacks(r.stderr) == 1  # the chief's, nothing from the others


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_read_from_a_stopped_ps_fails_within_seconds_naming_it():
    """A stopped ps task answers nothing: the chief's read of the variables (its forward pass)
    raises as soon as the cluster watch sees the task stopped, not at the read's 120 s timeout."""
    r = job(1, 1, "ps_stopped", "sgd", timeout=150)
    assert r.returncode == 1, r.stderr
    took = float(result(r.stdout).split("raised_after=")[1])
    assert took < 2.0, took  # the promise: a task stopped on this host is lost within a second or two
    lines = r.stderr.strip().splitlines()
    error = next(line for line in lines if line.startswith("stratagem.distribute.engines.ps_client.ParameterServerError"))
    assert re.search(r"parameter server ps:0 \(.+\) failed: its process \(pid \d+\) is stopped", error), error
    assert tracebacks(r.stderr) == 1, r.stderr  # the chief's, nothing from the others


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_lost_ps_restarts_the_job_from_its_last_checkpoint(tmp_path):
    """With --max-restarts, a ps task that dies starts the whole job again; the script restores
    its last checkpoint and trains on, and the end equals one process (as if nothing failed)."""
    argv = ["-m", "stratagem", "run", "--workers", "1", "--ps", "2", "--max-restarts", "1", "--grace-period", "20",
            SCRIPT, "ps_restart", "sgd", str(tmp_path)]
    r = run_script(argv, timeout=200)
    assert r.returncode == 0, r.stderr
    assert "RESULT start=6 restart=1 " in r.stdout, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert ("stratagem run: ps 0 failed (exit code 9); starting the whole job again (1 of 1 restarts), to go "
            "on from its last checkpoint") in lines, r.stderr
    error = next(line for line in lines if line.startswith("stratagem.distribute.engines.ps_client.ParameterServerError"))
    assert f"the last checkpoint this job saved: {tmp_path}" in error
    assert tracebacks(r.stderr) == 1  # the first chief's, nothing from the others


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_checkpoints_are_portable_both_ways(tmp_path):
    """Saved by the chief (variables and Adagrad's state read from the 2 ps tasks), restored in a
    plain process, training goes on identically; and a plain checkpoint restores onto the ps tasks."""
    r = job(1, 2, "checkpoint", "adagrad", str(tmp_path))
    assert_clean_run(r, what="the checkpoint job")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_misuse_gets_clear_errors():
    r = job(1, 1, "errors")
    assert_clean_run(r, what="the errors job")
    errors = [line for line in r.stdout.splitlines() if line.startswith("ERROR")]
    assert errors == [
        "ERROR SGD.step() on the coordinator: under ParameterServerStrategy the variables live on the ps "
        "tasks and are updated by the functions workers run",
        "ERROR could not ship the scheduled function '<lambda>' to worker",
        "ERROR ZeroDivisionError division by zero (raised by the scheduled function on worker:0)",
        "ERROR ClusterCoordinator needs a ParameterServerStrategy, got OneDeviceStrategy",
        "ERROR ValueError the fussy optimizer refuses (raised by the optimizer on parameter server ps:0) "
        "(raised by the scheduled function on worker:0)",
        "ERROR none after it: 0",
    ]


# --- the plan (pure) -------------------------------------------------------------------------------
def test_whole_variables_go_round_robin_and_partitioned_ones_split_over_the_next_tasks():
    f32 = torch.float32
    plans = plan_variables(
        [("emb", (10, 4), f32, True), ("w", (4, 4), f32, False), ("b", (4,), f32, False)],
        num_ps=2,
        partitioner=FixedShardsPartitioner(3),
    )
    # the embedding's 10 rows in 3 shards (4, 3, 3: tf's split) on ps 0, 1, 0; then w on ps 1,
    # b on ps 0 (the rotation goes on); w and b split too, capped at their rows
    assert plans[0] == VariablePlan(0, "emb", (10, 4), f32, True, (Shard("0/0", 0, 0, 4), Shard("0/1", 1, 4, 7), Shard("0/2", 0, 7, 10)))
    assert [(s.ps, s.start, s.stop) for s in plans[1].shards] == [(1, 0, 2), (0, 2, 3), (1, 3, 4)]
    assert str(plans[2]) == "b[4] -> ps0[0:2] ps1[2:3] ps0[3:4]"


def test_without_a_partitioner_each_variable_is_whole_and_a_later_scope_continues_the_rotation():
    f32 = torch.float32
    first = plan_variables([("a", (3,), f32, False), ("b", (3,), f32, False), ("c", (3,), f32, False)], 2, None)
    assert [p.shards[0].ps for p in first] == [0, 1, 0]
    later = plan_variables([("d", (3,), f32, False)], 2, None, first_vid=3, first_task=3)
    assert later[0].vid == 3 and later[0].shards == (Shard("3/0", 1, 0, 3),)


def test_min_size_partitioner_keeps_small_variables_whole():
    plans = plan_variables(
        [("big", (1 << 16, 32), torch.float32, True), ("small", (8, 8), torch.float32, False)],
        num_ps=2,
        partitioner=MinSizePartitioner(min_shard_bytes=1 << 20, max_shards=2),
    )
    assert [len(p.shards) for p in plans] == [2, 1]


def test_a_partitioner_answer_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="expected one count per axis"):
        plan_variables([("w", (4, 4), torch.float32, False)], 1, lambda shape, dtype: [1, 2])
    with pytest.raises(ValueError, match="at least one ps task"):
        plan_variables([("w", (4,), torch.float32, False)], 0, None)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fit_needs_steps_per_epoch_and_then_equals_fit_in_one_process():
    """Keras's rule under ParameterServerStrategy; the loss, a metric and the validation logs of
    every epoch and the trained variables equal fit in one process on the same batches."""
    r = job(1, 1, "fit", "sgd")
    assert_clean_run(r, what="fit under ParameterServerStrategy")
    assert "ERROR fit under ParameterServerStrategy needs steps_per_epoch (got None)" in r.stdout
    assert result(r.stdout) == (
        "RESULT history_diff=0 param_diff=0 keys=['loss', 'mae', 'val_loss', 'val_mae']"
    )


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_tasks_that_never_come_are_named(tmp_path):
    """The chief alone: the error names each missing task and its address, within the timeout."""
    import json

    from stratagem.cluster.launch import find_free_port

    port = find_free_port()
    cluster = {"chief": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}
    env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}})}
    r = run_script(["-c", "import stratagem as sg; sg.ParameterServerStrategy(timeout=2)"], env=env, timeout=40)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "RuntimeError: ParameterServerStrategy: worker:0 (127.0.0.1:1), ps:0 (127.0.0.1:2) did not join the "
        "cluster within 2s: start every task listed in TF_CONFIG (or use `stratagem run --workers N --ps P script.py`)"
    )


CHIEF_RUNS_ONE_FUNCTION = """
import os
import torch
import stratagem as sg

strategy = sg.ParameterServerStrategy()
with strategy.scope():
    model = torch.nn.Linear(2, 1)
coordinator = sg.coordinator.ClusterCoordinator(strategy)
coordinator.schedule(lambda: model(torch.ones(1, 2))).fetch()
"""
# no shutdown: the others find the chief gone by themselves
CHIEF_VANISHES = CHIEF_RUNS_ONE_FUNCTION + "os._exit(0)\n"
CHIEF_RAISES = CHIEF_RUNS_ONE_FUNCTION + "raise ValueError(\"a bug in the chief's script\")\n"


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_chief_that_raises_under_stratagem_run_is_the_one_failure_reported(tmp_path):
    """The tasks leave as soon as the chief says it failed, before its traceback is out and it
    ends: `stratagem run` must still report the chief (its exit code), not the first task to exit."""
    script = tmp_path / "job.py"
    script.write_text(CHIEF_RAISES)
    argv = ["-m", "stratagem", "run", "--workers", "1", "--ps", "1", str(script)]
    r = run_script(argv, timeout=80)
    assert r.returncode == 1, r.stderr
    lines = stratagem_lines(r.stderr)
    assert len(lines) == 3, r.stderr
    assert "stratagem run: chief failed (exit code 1)" in lines, r.stderr
    for task in ["ps", "worker"]:
        # told by the chief, or (a task busy for a second) finding it gone; or, on a loaded
        # machine, still on its way out 3 s after the chief ended, and stopped by the launcher
        mine = [line for line in lines if re.match(rf"stratagem(: {task}:0:| run: {task} 0 )", line)]
        assert len(mine) == 1, r.stderr
        assert re.fullmatch(
            rf"stratagem: {task}:0: the chief (failed \(ValueError: a bug in the chief's script\)|is lost \(.+\)); leaving"
            rf"|stratagem run: {task} 0 was still running 3s after the chief failed; stopping it",
            mine[0],
        ), r.stderr
    assert tracebacks(r.stderr) == 1, r.stderr  # the chief's
    assert "ValueError: a bug in the chief's script" in r.stderr.strip().splitlines()


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_when_the_chief_vanishes_the_other_tasks_leave_by_themselves(tmp_path):
    """Workers and ps tasks watch the chief through its TCPStore (no rpc pings: an rpc call in
    flight while the group's members change can crash a task); each leaves when it is gone."""
    script = tmp_path / "job.py"
    script.write_text(CHIEF_VANISHES)
    argv = ["-m", "stratagem", "run", "--workers", "1", "--ps", "1", "--grace-period", "30", str(script)]
    r = run_script(argv, timeout=80)
    assert r.returncode == 0, r.stderr
    # on this host its pid is seen gone, or its store's connection closed: whichever comes first
    lines = sorted(stratagem_lines(r.stderr))
    assert len(lines) == 2, r.stderr
    for line, task in zip(lines, ["ps:0", "worker:0"]):
        assert re.fullmatch(
            rf"stratagem: {task}: the chief is lost \((its process \(pid \d+\) is gone: killed or crashed"
            r"|its store at 127\.0\.0\.1:\d+ cannot be reached \(.+\))\); leaving",
            line,
        ), r.stderr
