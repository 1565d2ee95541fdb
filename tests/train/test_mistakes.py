"""The mistakes users make, answered at once with words that name them (issue 53): an infinite
distributed dataset without steps_per_epoch, learning rates that differ per replica, whole
tensors given as a dataset, numpy float64 batches, a [B, 1] prediction against a [B] target
with a torch loss, and MirroredStrategy(num_replicas="2")."""

from __future__ import annotations

import pytest
import torch
from mistakes_workers import (
    infinite_distributed,
    learning_rate_by_rank,
    learning_rate_by_rank_continuing,
    map_error_in_a_share,
    whole_tensors_and_float64,
)
from torch import nn

import stratagem as sg
from stratagem.data import Dataset
from stratagem.testing import run_workers
from stratagem.train import fit
from stratagem.train.losses import per_example_loss


@pytest.mark.timeout(150)
@pytest.mark.parametrize("form", ["distribute_dataset", "distribute_dataset_unbatched_source", "from_function"])
def test_an_infinite_distributed_dataset_without_steps_per_epoch_is_an_error_before_the_first_step(form):
    for r in run_workers(infinite_distributed, 2, args=(form,), timeout=120):
        assert r.value["error"] == "ValueError", r.value
        assert "over an infinite dataset" in r.value["message"] and "steps_per_epoch=N" in r.value["message"]
        assert r.value["seconds"] < 5, r.value


@pytest.mark.timeout(150)
def test_learning_rates_that_differ_per_replica_are_an_error_naming_the_replica_and_the_value():
    for r in run_workers(learning_rate_by_rank, 2, timeout=120):
        for kind in ("list", "dataset"):  # read whole and split; rebatched and auto-sharded
            got = r.value[kind]
            assert got["error"] == "ReplicaMismatchError", (kind, got)
            assert "the optimizer's settings (SGD) differ across replicas" in got["message"], got
            assert "param group 0 lr is 0.2 on replica 1 but 0.1 on replica 0" in got["message"], got
        assert r.value["same"] == {"error": None, "value": 1, "seconds": r.value["same"]["seconds"]}


@pytest.mark.timeout(150)
def test_whole_tensors_name_from_tensor_slices_and_numpy_floats_arrive_as_float32():
    for r in run_workers(whole_tensors_and_float64, 2, timeout=120):
        got = r.value["tuple"]
        assert got["error"] == "TypeError", got
        assert "a tuple of 2 whole arrays (shapes [16, 5], [16])" in got["message"], got
        assert "Dataset.from_tensor_slices((x, y)).batch(global_batch_size)" in got["message"], got
        assert r.value["dtypes"] == [("torch.float32", "torch.int64", (4, 5))] * 2


def test_whole_tensors_on_one_device_too():
    strategy = sg.get_strategy()
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    with pytest.raises(TypeError, match=r"Dataset\.from_tensor_slices\(\(x, y\)\)"):
        strategy.experimental_distribute_dataset((x, y))
    with pytest.raises(TypeError, match=r"one whole Tensor of shape \(16, 5\)"):
        strategy.experimental_distribute_dataset(x)
    with pytest.raises(TypeError, match=r"a list of 2 whole arrays"):
        strategy.experimental_distribute_dataset([x, y])
    # a list of batches of x (same rank) is batches, not whole arrays
    assert [b.shape for b in strategy.experimental_distribute_dataset([x[:8], x[8:]])] == [(8, 5), (8, 5)]


def _regression(n: int = 16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("loss", [nn.MSELoss(), nn.L1Loss(), nn.HuberLoss(), nn.functional.mse_loss])
def test_a_b1_prediction_against_a_b_target_with_a_torch_loss_is_an_error_naming_both_shapes(loss):
    x, y = _regression()
    model = nn.Linear(4, 1)  # outputs [B, 1]
    with pytest.raises(ValueError) as info:
        fit(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, Dataset.from_tensor_slices((x, y)).batch(8), verbose=0)
    message = str(info.value)
    assert "outputs of shape [8, 1] and targets of shape [8]" in message, message
    assert "broadcasts them to [8, 8]" in message and "y.unsqueeze(-1)" in message and "outputs.squeeze(-1)" in message
    # the reverse: [B] outputs against [B, 1] targets
    with pytest.raises(ValueError, match=r"outputs of shape \[8\] and targets of shape \[8, 1\].*outputs\.unsqueeze\(-1\)"):
        per_example_loss(loss, torch.randn(8), torch.randn(8, 1))


def test_keras_losses_match_the_shapes_as_keras_does():
    x, y = _regression()
    model = nn.Linear(4, 1)
    for loss in (sg.losses.MeanSquaredError(), "mse"):
        history = fit(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, Dataset.from_tensor_slices((x, y)).batch(8), verbose=0)
        assert len(history.history["loss"]) == 1
    out = torch.randn(8, 1)
    target = torch.randn(8)
    want = ((out[:, 0] - target) ** 2)
    torch.testing.assert_close(per_example_loss(sg.losses.MeanSquaredError(), out, target), want)


def test_torch_losses_with_matching_or_class_shapes_are_untouched():
    out, target = torch.randn(8, 1), torch.randn(8, 1)
    torch.testing.assert_close(per_example_loss(nn.MSELoss(), out, target), ((out - target) ** 2)[:, 0])
    logits, labels = torch.randn(8, 3), torch.randint(0, 3, (8,))
    torch.testing.assert_close(per_example_loss(nn.CrossEntropyLoss(), logits, labels),
                               nn.functional.cross_entropy(logits, labels, reduction="none"))


@pytest.mark.parametrize("value, words", [("2", "got '2' (str); use num_replicas=2"), (2.5, "got 2.5 (float)"), (True, "got True (bool)")])
def test_mirrored_strategy_num_replicas_of_the_wrong_kind_is_a_clear_error(value, words):
    with pytest.raises(TypeError, match="takes a whole number of replicas") as info:
        sg.MirroredStrategy(num_replicas=value)
    assert words in str(info.value)


def test_an_infinite_dataset_is_an_error_on_one_device_as_before():
    model = nn.Linear(5, 3)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match="is an infinite dataset .* steps_per_epoch is not set"):
        fit(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
            Dataset.from_tensor_slices((x, y)).batch(4).repeat(), verbose=0)
    dist = sg.get_strategy().experimental_distribute_dataset(Dataset.from_tensor_slices((x, y)).batch(4).repeat())
    with pytest.raises(ValueError, match="a distributed dataset .* over an infinite dataset"):
        fit(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), dist, verbose=0)
    # with steps_per_epoch it trains
    history = fit(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), dist, steps_per_epoch=3, verbose=0)
    assert len(history.history["loss"]) == 1


@pytest.mark.timeout(150)
def test_optimizer_settings_that_differ_are_an_error_under_on_failure_continue_too():
    for r in run_workers(learning_rate_by_rank_continuing, 2, timeout=120):
        assert r.value["error"] == "ReplicaMismatchError", r.value
        assert "param group 0 betas is (0.9, 0.99) on replica 1 but (0.9, 0.999) on replica 0" in r.value["message"], r.value


@pytest.mark.timeout(150)
def test_a_map_error_in_a_replicas_share_numbers_the_element_within_the_dataset():
    first = run_workers(map_error_in_a_share, 2, timeout=120, check=False, allow_stderr=None)[0].value
    assert first["error"] == "MapFunctionError", first
    assert "map function failed on element 11 of the dataset (element 7 of replica 0's share of it, of 2)" in first["message"], first
