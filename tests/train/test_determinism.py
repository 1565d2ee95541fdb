"""stratagem.experimental.enable_op_determinism: fit gives the same bits on one process and on any
number of data-parallel replicas (issue 34, item 1; docs/design/DETERMINISM.md)."""

from __future__ import annotations

import pytest
from determinism_workers import hashes, refused

from stratagem.testing import run_workers


@pytest.fixture(scope="module")
def one_process():
    return {dataset: run_workers(hashes, 1, args=("one", 1, dataset), timeout=120)[0].value for dataset in (False, True)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("kind", "replicas", "dataset"),
    [("mirrored", 2, False), ("mirrored", 3, False), ("multiworker", 2, False), ("mirrored", 2, True)],
    ids=["mirrored-2", "mirrored-3", "multiworker-2", "mirrored-2-dataset"],
)
def test_fit_gives_the_same_bits_on_any_number_of_replicas(one_process, kind, replicas, dataset):
    """AdamW, global clipping and dropout, global batches given as a list or as a stratagem Dataset
    (each replica's pipeline reading its share): the parameters' SHA-256 after two epochs equals
    one process's, on every replica; in the default mode (each replica's batch in one piece, its
    own dropout masks) it does not, so the equality is the mode's doing."""
    results = [r.value for r in run_workers(hashes, replicas, args=(kind, replicas, dataset), timeout=180)]
    one_process = one_process[dataset]
    want_hash, want_losses = one_process["deterministic"]
    for r in results:
        got_hash, got_losses = r["deterministic"]
        assert got_hash == want_hash
        assert got_losses == pytest.approx(want_losses, rel=1e-5)
    assert results[0]["default"][0] != one_process["default"][0]


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("batchnorm", "1 is BatchNorm1d in training mode, whose statistics are over a batch, not a piece"),
        ("batchnorm-loop", "BatchNorm1d is in training mode, whose statistics are over a batch, not a piece"),
        ("accumulation", "gradient_accumulation_steps is not supported with enable_op_determinism yet"),
        ("batch", r"must be a multiple of 5 x 1 replicas = 5 examples, split evenly; got 12 examples"),
    ],
)
def test_what_the_mode_cannot_make_invariant_is_refused(what, message):
    [result] = run_workers(refused, 1, args=(what,), timeout=120)
    assert message in result.value


@pytest.mark.timeout(200)
def test_nanogpt_as_published_gives_the_same_bits_on_two_replicas():
    from determinism_workers import nanogpt_hash

    [one] = run_workers(nanogpt_hash, 1, args=(1,), timeout=150)
    two = run_workers(nanogpt_hash, 2, args=(2,), timeout=150)
    assert [r.value for r in two] == [one.value, one.value]


@pytest.mark.timeout(300)
def test_a_run_killed_on_3_replicas_resumes_on_2_with_the_same_bits(tmp_path):
    """Killed mid-epoch 2 on 3 replicas, resumed from its backup on 2: the parameters' SHA-256
    equals the uninterrupted run's on one process (the pieces' dropout follows the update count
    the backup restores)."""
    from determinism_workers import resumed_hash

    [want] = run_workers(resumed_hash, 1, args=(1, str(tmp_path / "reference"), None), timeout=150)
    backup = str(tmp_path / "3-then-2")
    killed = run_workers(resumed_hash, 3, args=(3, backup, 6), timeout=150, check=False)
    assert all(r.returncode == -9 for r in killed), [r.stderr[-500:] for r in killed]
    for r in run_workers(resumed_hash, 2, args=(2, backup, None), timeout=150,
                         allow_stderr=[("keep their own 'rng'", "fewer replicas than saved RNG streams: said once")]):
        assert r.value["restored_from"].endswith("ckpt-6")
        assert r.value["hash"] == want.value["hash"]


@pytest.mark.timeout(300)
def test_the_custom_training_loop_gives_the_same_bits_on_any_number_of_replicas():
    """TensorFlow's custom training loop as its tutorial writes it (strategy.run of a step that
    clips and steps AdamW inside, strategy.reduce of the returned losses): strategy.run calls the
    step once per piece, and the parameters' SHA-256 after two epochs is one process's under
    Mirrored(2), Mirrored(3) and MultiWorker(2); the reported losses agree to float tolerance."""
    from determinism_workers import custom_loop_hash

    [one] = run_workers(custom_loop_hash, 1, args=("one", 1), timeout=150)
    for kind, n in [("mirrored", 2), ("mirrored", 3), ("multiworker", 2)]:
        for r in run_workers(custom_loop_hash, n, args=(kind, n), timeout=150):
            assert r.value["hash"] == one.value["hash"], (kind, n)
            assert r.value["loss"] == pytest.approx(one.value["loss"], rel=1e-6)


@pytest.mark.timeout(300)
def test_a_custom_loop_killed_on_3_replicas_resumes_on_2_with_the_same_bits(tmp_path):
    """The custom loop with a CheckpointManager (model, optimizer, the iterator's position,
    RNGState) after every step: killed after step 5 of 8 on 3 replicas, resumed on 2, it ends with
    the hash of one process that was never interrupted (RNGState carries the count of steps cut
    into pieces, which the pieces' dropout follows)."""
    from determinism_workers import custom_loop_resumed_hash

    [want] = run_workers(custom_loop_resumed_hash, 1, args=(1, str(tmp_path / "reference"), None), timeout=150)
    directory = str(tmp_path / "3-then-2")
    killed = run_workers(custom_loop_resumed_hash, 3, args=(3, directory, 5), timeout=150, check=False)
    assert all(r.returncode == -9 for r in killed), [r.stderr[-500:] for r in killed]
    for r in run_workers(custom_loop_resumed_hash, 2, args=(2, directory, None), timeout=150,
                         allow_stderr=[("keep their own 'rng'", "fewer replicas than saved RNG streams: said once")]):
        assert r.value["restored"].endswith("ckpt-5")
        assert r.value["hash"] == want.value["hash"]
