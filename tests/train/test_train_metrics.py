"""Metrics on one process: exact totals with partial batches, empty batches, masks and weights."""

from __future__ import annotations

import pytest
import torch

from stratagem.train import metrics as M


def test_mean_is_sum_over_count_not_mean_of_means():
    m = M.Mean()
    m.update_state(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    m.update_state(torch.tensor([10.0]))
    m.update_state(torch.zeros(0))  # an empty batch counts for nothing
    assert m.result().item() == pytest.approx(20.0 / 5)


def test_mask_and_weights_never_count_padding():
    m = M.SparseCategoricalAccuracy()
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 2.0]])
    labels = torch.tensor([0, 1, 1, 1])
    m.update_state(labels, logits, sample_weight=torch.tensor([1.0, 1.0, 1.0, 0.0]))  # last is padding
    assert m.result().item() == 2 / 3
    w = M.Mean()
    w.update_state(torch.tensor([1.0, 3.0]), sample_weight=torch.tensor([3.0, 1.0]))
    assert w.result().item() == 6 / 4


@pytest.mark.parametrize(
    "metric, y_true, y_pred, expected",
    [
        (M.Accuracy(), torch.tensor([1, 2, 3, 4]), torch.tensor([[1], [2], [0], [4]]), 3 / 4),
        (M.SparseCategoricalAccuracy(), torch.tensor([2, 0, 1]), torch.tensor([[0.1, 0.2, 0.7], [0.9, 0.1, 0.0], [0.5, 0.4, 0.1]]), 2 / 3),
        (M.TopKCategoricalAccuracy(k=2), torch.tensor([2, 0, 1]), torch.tensor([[0.1, 0.2, 0.7], [0.0, 0.1, 0.9], [0.5, 0.4, 0.1]]), 2 / 3),
        (M.TopKCategoricalAccuracy(k=1), torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]), torch.tensor([[0.1, 0.2, 0.7], [0.0, 0.1, 0.9]]), 1 / 2),
        (M.MeanSquaredError(), torch.tensor([[0.0, 0.0], [1.0, 1.0]]), torch.tensor([[1.0, 1.0], [1.0, 3.0]]), (1.0 + 2.0) / 2),
        (M.MeanAbsoluteError(), torch.tensor([0.0, 1.0]), torch.tensor([[2.0], [0.0]]), 1.5),
    ],
)
def test_values(metric, y_true, y_pred, expected):
    metric.update_state(y_true, y_pred)
    metric.update_state(y_true[:0], y_pred[:0])
    assert metric.result().item() == pytest.approx(expected, rel=1e-12)
    metric.reset_state()
    assert metric.result().item() == 0.0


def test_split_batches_give_the_whole_batch_result():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(11, 4, generator=g), torch.randint(0, 4, (11,), generator=g)
    whole, parts = M.SparseCategoricalAccuracy(), M.SparseCategoricalAccuracy()
    whole.update_state(labels, logits)
    for a, b in [(0, 6), (6, 11), (11, 11)]:
        parts.update_state(labels[a:b], logits[a:b])
    assert torch.equal(whole.result(), parts.result())


def test_sum_and_names():
    s = M.Sum()
    s.update_state(torch.tensor([1.0, 2.0]))
    s.update_state(torch.tensor(3.0))
    assert s.result().item() == 6.0
    assert M.get("mse").name == "mean_squared_error"
    assert M.get("sparse_categorical_accuracy").name == "sparse_categorical_accuracy"


def test_errors_say_what_was_received():
    with pytest.raises(ValueError, match="unknown metric 'f1'"):
        M.get("f1")
    with pytest.raises(ValueError, match="duplicate or reserved"):
        M.get_all(["mse", "mean_squared_error"])
    with pytest.raises(ValueError, match=r"integer labels of shape \(3,\)"):
        M.SparseCategoricalAccuracy().update_state(torch.zeros(3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="one weight"):
        M.Mean().update_state(torch.ones(3), sample_weight=torch.ones(2))
