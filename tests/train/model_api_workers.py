"""Workers for tests/train/test_export.py: summary, get_weights and export under MirroredStrategy(2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import stratagem as sg
from stratagem.train.model_api import ModelAPI, apply_trainable

# sg.Model has ModelAPI among its bases; until it does, the tests give it to Sequential here
Sequential = sg.Sequential if issubclass(sg.Sequential, ModelAPI) else type("Sequential", (ModelAPI, sg.Sequential), {})


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 4, generator=g), torch.randn(64, 2, generator=g)


def mirrored_api(out_dir: str) -> dict[str, Any]:
    """fit, then summary / get_weights / export / saved_model.save on every replica."""
    strategy = sg.MirroredStrategy(devices="cpu", num_replicas=2)
    torch.manual_seed(0)
    with strategy.scope():
        model = Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        model.compile(optimizer="adam", loss="mse")
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    lines: list[str] = []
    model.summary(print_fn=lines.append, input_shape=(None, 4))
    weights = model.get_weights()
    model.export(Path(out_dir) / "served", sample_input=x[:1], verbose=False)
    sg.saved_model.save(model, Path(out_dir) / "saved", sample_input=x[:5])
    loaded = sg.saved_model.load(Path(out_dir) / "served")
    again = sg.saved_model.load(Path(out_dir) / "saved")
    with strategy.scope():
        scoped = sg.saved_model.load(Path(out_dir) / "saved")
    outputs = {
        "model": model(x).detach(),
        "served": loaded.serve(x).detach(),
        "saved": again.signatures["serving_default"](x[:7])["output_0"].detach(),
        # TF's "save and load with a strategy": loaded in the scope, its function run by strategy.run
        "run": strategy.run(scoped.signatures["serving_default"], args=(x,))["output_0"].detach(),
    }
    # a frozen layer under the replicas' gradient reduction: it stays, the rest trains
    model.layers[0].trainable = False
    apply_trainable(model)  # fit calls it too
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return {
        "before": before,
        "after": {k: v.clone() for k, v in model.state_dict().items()},
        "summary": lines[0],
        "weights": weights,
        **outputs,
    }
