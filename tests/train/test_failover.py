"""FailureOptions(on_failure="continue"): fit goes on without a lost replica, with no restart and no
checkpoint, and in the deterministic mode ends bit for bit where the run without a failure ends
(issue 34, item 2; docs/FAILOVER.md)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from failover_workers import fit_through_failure

from stratagem.testing import run_workers

LOST = r"stratagem: replicas? [\d, ]+ lost \("
WHY = "the survivors say once which replica was lost and that training goes on"


@pytest.fixture(scope="module")
def reference():
    """One process, nothing failing: the hash and losses every survivor must end with."""
    return run_workers(fit_through_failure, 1, args=(1, {}), timeout=120)[0].value


def _survivors(replicas, victims, how="kill", deterministic=True):
    results = run_workers(fit_through_failure, replicas, args=(replicas, victims, how, deterministic), timeout=150,
                          check=False)  # fmt: skip
    lost = [r for r in results if r.rank in victims]
    kept = [r for r in results if r.rank not in victims]
    for r in lost:
        assert r.returncode == (-9 if how == "kill" else 1), r.stderr[-2000:]
    for r in kept:
        assert r.returncode == 0, r.stderr[-3000:]
    return kept


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("replicas", "victims", "how"),
    [
        (3, {2: 5}, "kill"),  # SIGKILL in its 5th piece: update 3 of epoch 1, mid-step
        (3, {1: 1}, "kill"),  # in the very first piece of the run
        (3, {1: 7}, "raise"),  # its program raises (its traceback is its own)
        (3, {2: 5, 1: 20}, "kill"),  # one after the other: 3 -> 2 -> 1 replicas
        (3, {1: 9, 2: 9}, "kill"),  # two at once
        (2, {1: 14}, "kill"),  # down to the last replica, in epoch 2
    ],
    ids=["kill-mid-step", "kill-first-piece", "raise", "two-in-turn", "two-at-once", "last-one-left"],
)
def test_a_lost_replica_leaves_the_run_that_never_failed(reference, replicas, victims, how):
    """The survivors end with the parameters' SHA-256 and the epochs' losses of one process that
    never failed (the deterministic mode: AdamW, clipping, dropout), with one fewer replica per loss."""
    kept = _survivors(replicas, victims, how)
    for r in kept:
        assert r.value["hash"] == reference["hash"]
        assert r.value["loss"] == reference["loss"]
        assert r.value["replicas"] == replicas - len(victims)
    chief = next(r for r in kept if r.rank == 0)
    assert len([line for line in chief.stderr.splitlines() if "training goes on with" in line]) == (
        2 if victims == {2: 5, 1: 20} else 1
    )


@pytest.mark.timeout(200)
def test_a_stopped_replica_is_gone_on_without_and_ended(reference):
    """Replica 2 stopped (SIGSTOP) mid-step: the others find it stopped, go on without it and end
    with the fault-free hash on 2 replicas; the stopped process (on their host) is ended, as the
    watchdog ends it without on_failure="continue", and the survivors say so once."""
    results = run_workers(fit_through_failure, 3, args=(3, {2: 5}, "stop", True, 6, 0, 0.02), timeout=150, check=False)
    [long_ref] = [r.value for r in run_workers(fit_through_failure, 1, args=(1, {}, "kill", True, 6), timeout=120)]
    for r in results[:2]:
        assert r.returncode == 0, r.stderr[-3000:]
        assert (r.value["hash"], r.value["loss"], r.value["replicas"]) == (long_ref["hash"], long_ref["loss"], 2)
    assert results[2].returncode == -9, results[2].stderr[-3000:]
    assert "is stopped (SIGSTOP): no collective with it can finish; it is ended" in results[0].stderr + results[1].stderr


@pytest.mark.timeout(200)
def test_multiworker_mirrored_goes_on_too(reference):
    """MultiWorkerMirroredStrategy(failure=FailureOptions(on_failure="continue")): a worker killed
    mid-step; the others end bit for bit where one process that never failed ends."""
    results = run_workers(fit_through_failure, 3, args=(3, {1: 5}, "kill", True, 2, 0, 0.0, "multiworker"),
                          timeout=150, check=False)  # fmt: skip
    assert results[1].returncode == -9
    for r in (results[0], results[2]):
        assert r.returncode == 0, r.stderr[-3000:]
        assert (r.value["hash"], r.value["loss"], r.value["replicas"]) == (reference["hash"], reference["loss"], 2)


@pytest.mark.timeout(200)
def test_without_the_deterministic_mode_the_job_goes_on_with_the_same_global_batch(reference):
    """The default mode goes on too: the survivors agree with each other and train on the same
    global batches (the loss of one process to float tolerance, not to the bit)."""
    kept = _survivors(3, {2: 5}, deterministic=False)
    assert kept[0].value["hash"] == kept[1].value["hash"]
    assert kept[0].value["loss"] == pytest.approx(reference["loss"], rel=0.05)


@pytest.mark.timeout(200)
def test_losing_the_store_host_is_todays_clear_error():
    """Replica 0 hosts the job's store: without it nobody can agree on anything, so the others end
    with the WorkerFailedError naming it, as without on_failure="continue" (no traceback; on a
    loaded machine a heartbeat's store call in flight when the store went may add torch's C++
    warning, as it may without on_failure="continue")."""
    results = run_workers(fit_through_failure, 3, args=(3, {0: 4}), timeout=150, check=False)
    for r in results[1:]:
        assert r.returncode == 1
        # the deterministic mode's exchange: an all-to-all, then an all-gather (comm/blocks.py)
        assert re.search(r"WorkerFailedError: (all_to_all|all_gather) failed because worker 0 failed", r.stderr), r.stderr[-2000:]
        assert "Traceback" not in r.stderr and "training goes on" not in r.stderr, r.stderr[-2000:]


def _script(tmp_path, victim, call, again_call=0):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("failover_script.py")
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run([sys.executable, str(script), str(out), str(victim), str(call), str(again_call)], capture_output=True,
                          text=True, timeout=150, cwd=tmp_path)  # fmt: skip
    import json

    return done, {f.stem: json.loads(f.read_text()) for f in out.iterdir()}


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_lost_replica_started_again_comes_back_from_a_live_peer(tmp_path):
    """MirroredStrategy(3) starting its replicas itself, max_restarts=1: replica 2 is killed
    mid-step, the others go on, rank 0 starts it again and it is let in between two steps with
    the training state of a live peer (no checkpoint): all three end with the hash and losses of
    one process that never failed, on 3 replicas, and the command exits 0."""

    [want] = [r.value for r in run_workers(fit_through_failure, 1, args=(1, {}, "kill", True, 10), timeout=120)]
    done, results = _script(tmp_path, victim=2, call=5)
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(results) == {"rank0", "rank1", "rank2-again"}
    for r in results.values():
        assert (r["hash"], r["loss"], r["replicas"]) == (want["hash"], want["loss"], 3)
    lines = done.stderr.strip().splitlines()
    assert re.match(r"stratagem: replica 2 lost \((all_to_all|all_gather) failed because worker 2 failed", lines[0]), lines[0]
    assert lines[1:] == ["stratagem: replica 2 came back; training goes on with 3 replicas"]


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_replica_started_again_after_training_ended_ends_quietly(tmp_path):
    """Killed in the last step, started again: the training ends before it can be let in; it ends
    (by itself, or stopped by rank 0 when it is still starting), one line says so, and the
    command's exit code is 0."""
    done, results = _script(tmp_path, victim=1, call=119)  # its last piece of the last step
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(results) == {"rank0", "rank2"}
    assert ("stratagem: replica 1 was started again after the job's training had ended; there is nothing "
            "left for it to do; it ends" in done.stderr) or (
            "stratagem: replica 1 was started again too late to rejoin (the training had ended); it was stopped"
            in done.stderr)  # fmt: skip
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_replica_that_came_back_and_fails_again_is_lost_again(tmp_path):
    """Killed, started again, let in, killed again after a few pieces (no restart left): the two
    others go on once more and end with the hash and losses of the run in which nothing failed."""

    [want] = [r.value for r in run_workers(fit_through_failure, 1, args=(1, {}, "kill", True, 10), timeout=120)]
    done, results = _script(tmp_path, victim=2, call=5, again_call=6)
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(results) == {"rank0", "rank1"}
    for r in results.values():
        assert (r["hash"], r["loss"], r["replicas"]) == (want["hash"], want["loss"], 2)
    said = [line.split(" (")[0] for line in done.stderr.strip().splitlines()]
    assert said == ["stratagem: replica 2 lost", "stratagem: replica 2 came back; training goes on with 3 replicas",
                    "stratagem: replica 2 lost"], done.stderr  # fmt: skip


@pytest.mark.skipif(bool(__import__("stratagem.testing.hosts", fromlist=["x"]).unavailable()), reason="needs root and ip")
@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_worker_whose_host_is_cut_off_is_gone_on_without(tmp_path):
    """Three TF_CONFIG workers on hosts of their own; worker 2's link is cut silently mid-training
    (no reset: its collectives would wait out gloo's timeout). The others find it silent, give up
    their wait, agree and go on: they end with the hash and losses of one process that never
    failed. The cut worker ends with the clear error that it lost the job's store."""
    import json
    import subprocess
    import sys
    import time
    from pathlib import Path

    from stratagem.testing.hosts import Hosts, job_env

    [want] = [r.value for r in run_workers(fit_through_failure, 1, args=(1, {}, "kill", True, 6), timeout=120)]
    repo = Path(__file__).resolve().parents[2]
    script = Path(__file__).with_name("failover_cut_script.py")
    with Hosts(3) as hosts:
        workers = [f"{h.address}:2222" for h in hosts]
        procs = []
        for i, h in enumerate(hosts):
            tf_config = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
            env = job_env(OMP_NUM_THREADS="1", PYTHONPATH=str(repo / "src"), TF_CONFIG=tf_config)
            procs.append(h.popen([sys.executable, str(script), str(tmp_path)], env=env, cwd=repo,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
        progress = tmp_path / "progress2"
        deadline = time.monotonic() + 90
        while not (progress.exists() and progress.read_text().strip() and int(progress.read_text()) >= 6):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                for p in procs:
                    p.kill()
                raise AssertionError("worker 2 never got to its 6th piece:\n" + "\n=====\n".join(
                    p.communicate()[0][-3000:] for p in procs))
            time.sleep(0.05)
        hosts[2].cut()
        outs = [p.communicate(timeout=150)[0] for p in procs]
    report = "\n=====\n".join(o[-3000:] for o in outs)
    assert [p.returncode for p in procs] == [0, 0, 1], report
    for r in (0, 1):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert (got["hash"], got["loss"], got["replicas"]) == (want["hash"], want["loss"], 2), report
    assert "stratagem: replica 2 lost" in outs[0], report
    assert "WorkerFailedError" in outs[2], report


_HOOKS = [
    ("on_train_begin", 1, False),  # before the first step
    ("on_epoch_begin", 2, False),  # between epochs
    ("on_train_batch_begin", 5, False),  # between steps, before the input is read
    ("on_train_batch_end", 3, False),  # between steps, after the commit
    ("on_epoch_end", 1, False),  # after the epoch's last update, before the stop vote
    ("on_test_begin", 1, True),  # validation's start
    ("on_test_batch_end", 1, True),  # inside validation
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("hook", "call", "validate"),
    [pytest.param(*h, marks=[] if h[0] == "on_train_batch_end" else [pytest.mark.slow]) for h in _HOOKS],
    ids=[h[0] for h in _HOOKS],
)
def test_a_replica_lost_in_a_callback_costs_one_step_and_keeps_the_fault_free_bits(reference, hook, call, validate):
    """A replica SIGKILLed between steps, in a user callback's hook (where a Keras-style logger
    runs), in validation or before the first step: the survivors go on, with the fault-free bits."""
    results = run_workers(fit_through_failure, 3, args=(3, {2: call}, "kill", True, 2, 0, 0.0, "mirrored", hook, validate),
                          timeout=150, check=False)  # fmt: skip
    for r in results:
        if r.rank == 2:
            assert r.returncode == -9, r.stderr[-2000:]
            continue
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.value["hash"] == reference["hash"]
        assert r.value["loss"] == reference["loss"]
        assert r.value["replicas"] == 2


#: moments (milliseconds after fit began) of the random-moment kills: wherever the process is then
#: (fit's own syncs at its start, the input's vote, a piece, the exchange, the commit, a callback,
#: the stop vote...); fit itself takes about 0.25 s here, so a few trials kill after its end
_MOMENTS = [random.Random(53).randint(0, 320) for _ in range(100)]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("trial", range(len(_MOMENTS)))
def test_a_kill_at_a_random_moment_costs_one_step_and_keeps_the_fault_free_bits(reference, trial):
    """Issue 53: a kill at a random wall-clock moment (not a random step), 100 trials, 100
    fault-free hashes."""
    ms = _MOMENTS[trial]
    results = run_workers(fit_through_failure, 3, args=(3, {2: ms}, "kill", True, 2, 0, 0.0, "mirrored", "clock"),
                          timeout=90, check=False)  # fmt: skip
    for r in results:
        if r.rank == 2:  # (0: it ended before its moment came)
            assert r.returncode in (-9, 0), r.stderr[-2000:]
            continue
        assert r.returncode == 0, f"killed at {ms} ms: " + r.stderr[-4000:]
        assert r.value["hash"] == reference["hash"], f"killed at {ms} ms"
        assert r.value["loss"] == reference["loss"], f"killed at {ms} ms"
        assert r.value["replicas"] in (2, 3)  # 3: the kill came after fit's end


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_rank_0_lost_costs_one_step_as_any_replica(reference, tmp_path):
    """Issue 49, item 2: a self-launched job under on_failure="continue" keeps its store in a
    process that trains nothing (a store keeper), so rank 0, the process the user started, is
    lost like any replica: SIGKILLed mid-step, the two others go on and end with the fault-free
    bits, the store keeper ends once they have, and nothing is left running."""
    job = Path(__file__).with_name("lose_rank0_job.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(job), str(tmp_path), "0", "5"], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:  # the pipes close once every process of the job (the keeper too) is ending
        _, err = proc.communicate(timeout=150)
    finally:
        leftover = _group_outlives(proc.pid, 5.0)
    assert proc.returncode == -9, err[-3000:]
    assert not leftover, "a process of the job outlived it"
    assert re.search(r"stratagem: replica 0 lost \(.*\); training goes on with 2 replicas", err), err[-3000:]
    for rank in (1, 2):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["hash"] == reference["hash"]
        assert result["loss"] == reference["loss"]
        assert result["replicas"] == 2
    assert not (tmp_path / "0.json").exists()


def _group_outlives(pgid: int, grace: float) -> bool:
    """Whether a process of group ``pgid`` is still there ``grace`` seconds on (then it is killed)."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.05)
    os.killpg(pgid, signal.SIGKILL)
    return True
