"""Keras's loss names for fit: ``"mse"``, ``"sparse_categorical_crossentropy"``, ...

A name means what it means in Keras: it stands for a new instance of its Keras loss class in
``stratagem.train.losses`` (``"sparse_categorical_crossentropy"`` is
``SparseCategoricalCrossentropy()``), called ``(y_true, y_pred)``. So the cross-entropies take
**probabilities** (a model ending in softmax/sigmoid; Keras's default ``from_logits=False``):
for logits pass ``sg.losses.SparseCategoricalCrossentropy(from_logits=True)`` or a torch loss
(``nn.CrossEntropyLoss()``). The first batch is checked: logits given to a name that expects
probabilities raise a ValueError saying so. Regression losses compare ``[B, 1]`` predictions
with ``[B]`` targets as Keras does (torch would broadcast them to ``[B, B]``).
"""

from __future__ import annotations

from typing import Any

from stratagem.train.losses import KERAS_NAMES, get

#: The names fit accepts (each a Keras loss class).
LOSSES = KERAS_NAMES


def resolve(loss: Any) -> Any:
    """``loss`` itself, or the Keras loss a name stands for (a clear error for unknown names); a
    Keras-order function of ``stratagem.losses`` becomes its Loss (called ``(y_true, y_pred)``)."""
    return get(loss)
