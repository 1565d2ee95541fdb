"""The thread engine snapshots its input every SNAP_EVERY elements, not every element (a
shuffle's state costs O(buffer)), and still resumes exactly from any position."""

import itertools
import json

import helpers
import pytest

from stratagem.data import Dataset, assert_resumes_exactly, parallel, shuffle


def make(deterministic=None):
    return (Dataset.range(100).shuffle(50, seed=1)
            .map(helpers.noisy, num_parallel_calls=3, with_rng=True, seed=2,
                 use_processes=False, deterministic=deterministic))


@pytest.mark.timeout(60)
def test_resumes_exactly_between_snapshots(monkeypatch):
    assert_resumes_exactly(make, ks=[0, 1, 15, 16, 17, 50, 99])
    calls = []
    original = shuffle._ShuffleIterator.state_dict

    def counting(self):
        calls.append(1)
        return original(self)

    monkeypatch.setattr(shuffle._ShuffleIterator, "state_dict", counting)
    assert len(list(make())) == 100
    assert len(calls) <= 100 // parallel.SNAP_EVERY + 2


@pytest.mark.timeout(60)
def test_nondeterministic_resume_between_snapshots():
    with make(False).iterator(epoch=0, seed=1) as it:
        head = [float(x[0]) for x in itertools.islice(it, 37)]
        state = json.loads(json.dumps(it.state_dict()))
    with make(False).iterator_from_state(state) as it:
        rest = [float(x[0]) for x in it]
    assert sorted(head + rest) == [float(i) for i in range(100)]


def test_engine_decision_table():
    from stratagem.data.autotune import decide

    assert decide(1.9, 2.0, 2) == "threads"  # scales: GIL-free (or I/O)
    assert decide(1.0, 1.95, 2) == "processes"  # holds the GIL
    assert decide(1.3, 1.6, 2) == "threads"  # scales as far as the shared machine allows
    assert decide(1.0, 1.1, 2) == "processes"  # machine too busy to tell: the safe choice
    assert decide(3.1, 4.0, 4) == "threads" and decide(1.2, 3.9, 4) == "processes"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gil_bound_work_never_looks_parallel_on_a_busy_machine():
    """CI failure: pure Python measured 1.75x on 2 threads (serial run slowed by another
    process), so AUTOTUNE put it on threads. With busy processes beside it, up to 1 in 40
    wall-clock measurements crossed the threshold (2.24x with three); the CPU-time bound keeps
    them at or under 1.0 (the run queue wait is not counted as waiting work)."""
    import subprocess
    import sys

    import engine_helpers as eh

    from stratagem.data.autotune import SCALES, thread_speedup

    def held() -> None:
        for i in range(9):
            eh.py_work(i)

    def waits() -> None:
        for i in range(9):
            eh.sleepy(i)

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        got = [thread_speedup(held, 2) for _ in range(40)]
        waiting = sorted(thread_speedup(waits, 2) for _ in range(5))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    # the lowest speed-up decide() takes for threads: SCALES times a reference of 1.5
    assert max(got) < SCALES * 1.5, sorted(got)[-5:]
    # waiting work is not capped at 1.0 (how far above depends on how fast a loaded machine
    # wakes the sleepers: 1.49x median beside four busy processes, 1.9x idle)
    assert waiting[2] > 1.2, waiting


@pytest.mark.timeout(60)
def test_stacked_autotune_maps_measure_one_inside_the_other():
    import engine_helpers as eh

    from stratagem.data import AUTOTUNE

    ds = (Dataset.range(24).map(eh.py_work, num_parallel_calls=AUTOTUNE)
          .map(eh.sleepy, num_parallel_calls=AUTOTUNE).batch(5))
    assert [int(x) for b in ds for x in b] == [eh.py_work(i) for i in range(24)]
