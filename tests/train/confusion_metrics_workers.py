"""Workers for tests/train/test_confusion_metrics.py: a binary classifier compiled with the
count-based metrics by name and as objects (stratagem's and torchmetrics'), fit and evaluated on
one device and on 2 CPU replicas."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

import stratagem as sg


def data() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((90, 5)).astype("float32")  # 90 rows: partial last batches, on 2 replicas too
    y = (x[:, :1] + 0.8 * rng.standard_normal((90, 1)) > 0).astype("float32")
    sw = (rng.random(90) * 3).astype("float32")
    return x, y, sw


def metrics() -> tuple[list[Any], list[Any]]:
    from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

    unweighted = ["auc", "precision", "recall", sg.metrics.AUC(curve="PR", name="pr_auc"),
                  sg.metrics.F1Score(threshold=0.5), BinaryAUROC(thresholds=50), BinaryAccuracy()]
    weighted = ["auc", sg.metrics.Precision(thresholds=0.4, name="precision_at_04")]
    return unweighted, weighted


def program(strategy: Any) -> dict[str, Any]:
    x, y, sw = data()
    unweighted, weighted = metrics()
    with strategy.scope():
        torch.manual_seed(0)
        model = sg.Sequential(nn.Linear(5, 1), nn.Sigmoid())
        model.compile(optimizer=sg.optimizers.SGD(0.1), loss="binary_crossentropy", metrics=unweighted,
                      weighted_metrics=weighted)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    h = model.fit(x, y, sample_weight=sw, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  validation_data=(x[:40], y[:40], sw[:40]))
    model.load_state_dict(initial)  # the same weights everywhere: the counts must be exactly one device's
    evaluated = model.evaluate(x, y, sample_weight=sw, batch_size=25, verbose=0, return_dict=True)
    return {"history": dict(h.history), "evaluate": evaluated}


def mirrored_program() -> dict[str, Any]:
    return program(sg.MirroredStrategy(devices="cpu", num_replicas=2))


def custom_loop() -> dict[str, Any]:
    """The metrics updated inside strategy.run on each replica's slice; result() is every
    replica's examples' value, on every replica."""
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    x, y, sw = data()
    g = torch.Generator().manual_seed(1)
    probs = torch.rand(90, 1, generator=g)
    made = [sg.metrics.AUC(), sg.metrics.AUC(curve="PR"), sg.metrics.Precision(), sg.metrics.Recall(),
            sg.metrics.F1Score(average="micro", threshold=0.5), sg.metrics.MeanIoU(2)]
    batches = [(torch.from_numpy(y[i : i + 15]), probs[i : i + 15], torch.from_numpy(sw[i : i + 15]))
               for i in range(0, 90, 15)]

    def step(yb: torch.Tensor, pb: torch.Tensor, wb: torch.Tensor) -> None:
        for m in made[:-1]:
            m.update_state(yb, pb, sample_weight=wb)
        made[-1].update_state(yb.long(), (pb > 0.5).long())

    for yb, pb, wb in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(yb, pb, wb))
    sg.metrics.sync_metrics(strategy, made)  # one collective; then result() and global_totals() are global
    return {"results": [float(m.result()) for m in made], "totals": [m.global_totals().tolist() for m in made],
            "probs": probs.tolist()}
