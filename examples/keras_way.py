# needs scikit-learn (its digits): pip install 'stratagem[demo]'
import numpy as np
from sklearn.datasets import load_digits
from torch import nn

import stratagem as sg

digits = load_digits()                                  # 1797 8x8 images, shipped with scikit-learn
x, y = (digits.data / 16).astype(np.float32), digits.target

strategy = sg.MirroredStrategy("cpu", num_replicas=2)
with strategy.scope():
    model = sg.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10), nn.Softmax(dim=-1))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])

history = model.fit(x, y, batch_size=64, epochs=5, validation_split=0.2, verbose=0)
loss, acc = model.evaluate(x, y, batch_size=128, verbose=0)   # [loss, accuracy], as Keras returns
probs = model.predict(x[:3], verbose=0)                        # shape (3, 10)
model.save("digits_model.keras")                               # one file: config, weights, optimizer
sg.print(f"val_accuracy {history.history['val_accuracy'][-1]:.3f} accuracy {acc:.3f} predict {tuple(probs.shape)}")
