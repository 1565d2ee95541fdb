"""keras-io's guide "Save, serialize, and export models", in stratagem.

https://keras.io/guides/serialization_and_saving/ (keras-team/keras-io
guides/serialization_and_saving.py): ``model.save("my_model.keras")`` and ``load_model``,
training continued on the reloaded model, a registered custom model with ``get_config``,
``save_weights`` / ``load_weights``, and ``export`` for serving. ``python
examples/tutorials/keras_serialization_and_saving.py`` in a scratch directory (it writes there, as
the guide does); ``NUM_REPLICAS=2``: models made in a ``MirroredStrategy`` of 2 CPU replicas.

What differs from the guide: ``keras.Input(shape=(32,))`` + ``Dense(1)`` is ``nn.Linear(32, 1)``
made after ``torch.manual_seed(0)``, data from ``np.random.default_rng(0)``, fits with
``shuffle=False`` (so tests/test_keras_guides.py compares with Keras 3's numbers); ``export``
writes stratagem's serving form (``torch.export`` programs), read back with
``sg.saved_model.load`` (the guide's ``format="tf_saved_model"`` needs TensorFlow).
Differs, and said here: ``load_model("my_model.keras")`` of a model of built-in layers needs the
architecture (``model=``), where Keras rebuilds it from the file (only a class registered with
``get_config`` is rebuilt without it); the served output requires grad (``.detach()``).
"""

import os

import numpy as np
import torch
from torch import nn

import stratagem as sg

print = sg.print

NUM_REPLICAS = int(os.environ.get("NUM_REPLICAS", "1"))
strategy = sg.MirroredStrategy("cpu", num_replicas=NUM_REPLICAS) if NUM_REPLICAS > 1 else sg.get_strategy()
print(f"replicas: {[strategy.num_replicas_in_sync]}")


def show(tag, value):
    print(f"{tag}: {value!r}")


def get_model():
    # Create a simple model.
    torch.manual_seed(0)
    with strategy.scope():
        model = sg.Sequential(nn.Linear(32, 1))
        model.compile(optimizer=sg.optimizers.Adam(), loss="mean_squared_error")
    return model


rng = np.random.default_rng(0)
test_input = rng.random((128, 32)).astype("float32")
test_target = rng.random((128, 1)).astype("float32")

model = get_model()

# Train the model.
show("fit", model.fit(test_input, test_target, shuffle=False, verbose=0).history["loss"])

# Calling `save('my_model.keras')` creates a zip archive `my_model.keras`.
model.save("my_model.keras")

# It can be used to reconstruct the model identically.
with strategy.scope():
    reconstructed_model = sg.load_model("my_model.keras", model=sg.Sequential(nn.Linear(32, 1)))

# Let's check:
np.testing.assert_allclose(
    model.predict(test_input, verbose=0), reconstructed_model.predict(test_input, verbose=0)
)
show("predict", model.predict(test_input[:3], verbose=0).tolist())

# The reconstructed model is already compiled and has retained the optimizer
# state, so training can resume:
show("fit reconstructed", reconstructed_model.fit(test_input, test_target, shuffle=False, verbose=0).history["loss"])
show("fit saved", model.fit(test_input, test_target, shuffle=False, verbose=0).history["loss"])


# --- Custom objects: a registered class with get_config ----------------------------------------
@sg.register_keras_serializable(package="my_package", name="custom_fn")
def custom_fn(x):
    return x**2


@sg.register_keras_serializable(package="MyModels")
class CustomModel(sg.Model):
    def __init__(self, hidden_units):
        super().__init__()
        self.hidden_units = hidden_units
        self.dense_layers = nn.ModuleList(
            [nn.Linear(i, u) for i, u in zip([32, *hidden_units[:-1]], hidden_units)]
        )

    def forward(self, inputs):
        x = inputs
        for layer in self.dense_layers:
            x = layer(x)
        return x

    def get_config(self):
        return {"hidden_units": self.hidden_units}


torch.manual_seed(0)
with strategy.scope():
    model = CustomModel([16, 16, 10])
    model.compile(optimizer="adam", loss="mse")
pred = model(torch.from_numpy(test_input))
model.save("custom_model.keras")
with strategy.scope():
    loaded_model = sg.load_model("custom_model.keras")  # the class rebuilt from its registration
np.testing.assert_allclose(loaded_model(torch.from_numpy(test_input)).detach().numpy(), pred.detach().numpy())
show("custom class", [type(loaded_model).__name__, loaded_model.hidden_units])

# --- Saving & loading only the weights values ----------------------------------------------------
model = get_model()
model.save_weights("my_model.weights.h5")
other = get_model()
with torch.no_grad():
    for p in other.parameters():
        p.zero_()
other.load_weights("my_model.weights.h5")
np.testing.assert_allclose(other.predict(test_input, verbose=0), model.predict(test_input, verbose=0))

# --- Exporting for inference ---------------------------------------------------------------------
model.export("exported_model")
reloaded = sg.saved_model.load("exported_model")
# differs: the served output requires grad (the loaded program's weights do): .detach() before numpy
served = reloaded.serve(torch.from_numpy(test_input)).detach()
np.testing.assert_allclose(np.asarray(served), model.predict(test_input, verbose=0), rtol=1e-6, atol=1e-6)
show("served", np.asarray(served)[:3].tolist())
