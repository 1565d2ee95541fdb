"""Loud instead of silent: a loss function that sums over the batch is refused by fit (it would
give other parameters on each number of replicas), with the fix in the message."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.train.losses import per_example_loss


def test_a_summing_loss_function_is_refused_with_the_fix():
    out, y = torch.randn(8, 1), torch.randn(8, 1)
    with pytest.raises(ValueError, match=r"loss_fn returned the sum of the batch's losses.*reduction='mean'.*compute_average_loss"):
        per_example_loss(lambda o, t: F.mse_loss(o, t, reduction="sum"), out, y)
    # a mean is what fit assumes: accepted, one loss per example
    got = per_example_loss(lambda o, t: F.mse_loss(o, t), out, y)
    assert got.shape == (8,)


def test_fit_refuses_a_summing_loss_function():
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 3), torch.randn(16, 1)
    with pytest.raises(ValueError, match="sum of the batch's losses"):
        sg.fit(model, opt, lambda o, t: ((o - t) ** 2).sum(), [(x, y)], epochs=1, verbose=0)
