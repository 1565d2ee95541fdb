"""keras-io's guide "Writing a training loop from scratch in PyTorch", in stratagem.

https://keras.io/guides/writing_a_custom_training_loop_in_torch/ (keras-team/keras-io
guides/writing_a_custom_training_loop_in_torch.py): a model, a Keras optimizer and loss used in a
plain PyTorch loop over a ``DataLoader`` (``zero_grad``, ``backward``, ``trainable_weights``,
``optimizer.apply``), then the same loop with ``CategoricalAccuracy`` metrics and a validation
loop. ``python examples/tutorials/keras_training_loop_from_scratch.py``.

What differs from the guide: MNIST (a download) is scikit-learn's digits (64 inputs; as in the
guide, the pixels are not rescaled), the model is torch layers made after
``torch.manual_seed(0)``, the ``DataLoader`` has ``shuffle=False`` (the guide's ``True``) so
tests/test_keras_guides.py compares each number with Keras 3's; 2 epochs (3 in the guide). The
guide has no strategy, and neither has the port (one process). Its last section (``add_loss`` in
an ``ActivityRegularizationLayer``, ``model.losses``) is not ported: stratagem has no ``add_loss``.
"""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg

print(f"replicas: {[1]}")


def show(tag, value):
    print(f"{tag}: {value!r}")


def get_model():
    torch.manual_seed(0)
    return sg.Sequential(
        nn.Linear(64, 64), nn.ReLU(),  # keras.layers.Dense(64, activation="relu")
        nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, 10),  # keras.layers.Dense(10, name="predictions")
    )


# Create load up the model, the optimizer and the loss
model = get_model()
optimizer = sg.optimizers.Adam(learning_rate=1e-3)
loss_fn = sg.losses.CategoricalCrossentropy(from_logits=True)

batch_size = 32
digits = load_digits()
x_train, y_train = digits.data[:1500].astype("float32"), digits.target[:1500]
x_test, y_test = digits.data[1500:].astype("float32"), digits.target[1500:]
y_train = np.eye(10, dtype="float32")[y_train]  # keras.utils.to_categorical
y_test = np.eye(10, dtype="float32")[y_test]

# Reserve 300 samples for validation (10,000 in the guide).
x_val = x_train[-300:]
y_val = y_train[-300:]
x_train = x_train[:-300]
y_train = y_train[:-300]

# Create torch Datasets
train_dataset = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
val_dataset = torch.utils.data.TensorDataset(torch.from_numpy(x_val), torch.from_numpy(y_val))
train_dataloader = torch.utils.data.DataLoader(train_dataset, batch_size=batch_size, shuffle=False)
val_dataloader = torch.utils.data.DataLoader(val_dataset, batch_size=batch_size, shuffle=False)

epochs = 2
losses = []
for epoch in range(epochs):  # noqa: B007 - the guide's names
    for step, (inputs, targets) in enumerate(train_dataloader):
        # Forward pass
        logits = model(inputs)
        loss = loss_fn(targets, logits)

        # Backward pass
        model.zero_grad()
        loss.backward()

        # Optimizer variable updates
        trainable_weights = [v for v in model.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            optimizer.apply(gradients, trainable_weights)

        losses.append(float(loss.detach()))
        # Log every 10 batches (100 in the guide).
        if step % 10 == 0:
            print(f"Training loss (for 1 batch) at step {step}: {loss.detach().numpy():.4f}")
            print(f"Seen so far: {(step + 1) * batch_size} samples")
show("losses", losses)

# --- Low-level handling of metrics ---------------------------------------------------------------
model = get_model()
optimizer = sg.optimizers.Adam(learning_rate=1e-3)
loss_fn = sg.losses.CategoricalCrossentropy(from_logits=True)

# Prepare the metrics.
train_acc_metric = sg.metrics.CategoricalAccuracy()
val_acc_metric = sg.metrics.CategoricalAccuracy()

accuracies = []
for epoch in range(epochs):
    print(f"\nStart of epoch {epoch}")
    for step, (inputs, targets) in enumerate(train_dataloader):  # noqa: B007 - the guide's
        logits = model(inputs)
        loss = loss_fn(targets, logits)
        model.zero_grad()
        trainable_weights = [v for v in model.trainable_weights]
        loss.backward()
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            optimizer.apply(gradients, trainable_weights)

        # Update training metric.
        train_acc_metric.update_state(targets, logits)

    # Display metrics at the end of each epoch.
    train_acc = train_acc_metric.result()
    print(f"Training acc over epoch: {float(train_acc):.4f}")

    # Reset training metrics at the end of each epoch
    train_acc_metric.reset_state()

    # Run a validation loop at the end of each epoch.
    for x_batch_val, y_batch_val in val_dataloader:
        val_logits = model(x_batch_val, training=False)
        # Update val metrics
        val_acc_metric.update_state(y_batch_val, val_logits)
    val_acc = val_acc_metric.result()
    val_acc_metric.reset_state()
    print(f"Validation acc: {float(val_acc):.4f}")
    accuracies.append([float(train_acc), float(val_acc)])
show("accuracies", accuracies)
