"""keras.utils.Sequence as the Keras guide writes it, read by fit (issue 30)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import stratagem as sg


class CIFAR10Sequence(sg.utils.Sequence):
    """The guide's example, on arrays made here: batches by index, reshuffled at each epoch's end."""

    def __init__(self, x_set, y_set, batch_size):
        super().__init__()
        self.x, self.y = x_set, y_set
        self.batch_size = batch_size
        self.epochs_ended = 0

    def __len__(self):
        return math.ceil(len(self.x) / self.batch_size)

    def __getitem__(self, idx):
        low = idx * self.batch_size
        high = min(low + self.batch_size, len(self.x))
        return self.x[low:high], self.y[low:high]

    def on_epoch_end(self):
        self.epochs_ended += 1


def test_fit_reads_a_sequence_as_its_batches_and_calls_on_epoch_end():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((50, 4)).astype("float32"))
    y = torch.from_numpy((rng.random(50) * 3).astype("int64"))
    seq = CIFAR10Sequence(x, y, 16)
    torch.manual_seed(0)
    model = sg.Sequential(nn.Linear(4, 3), nn.Softmax(dim=-1))
    model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(seq, epochs=3, verbose=0)
    assert seq.epochs_ended == 3 and len(history.history["loss"]) == 3
    # the same training as the arrays given with the same batch size, unshuffled
    torch.manual_seed(0)
    same = sg.Sequential(nn.Linear(4, 3), nn.Softmax(dim=-1))
    same.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    want = same.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    assert history.history["loss"] == pytest.approx(want.history["loss"], rel=1e-6)
    assert model.evaluate(seq, verbose=0) == pytest.approx(same.evaluate(x, y, batch_size=16, verbose=0), rel=1e-6)


def test_a_sequence_missing_its_methods_or_asking_for_workers_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="must implement __len__"):
        len(sg.utils.Sequence())
    with pytest.raises(ValueError, match="workers=.*not offered"):
        sg.utils.PyDataset(workers=4)
