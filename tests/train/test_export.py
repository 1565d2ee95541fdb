"""Export for serving (issue 50, item 3): ``model.export(path)`` (Keras 3's) and
``stratagem.saved_model.save`` / ``load`` (``tf.saved_model``'s) on ``torch.export``.

The artifact is loaded and called in a fresh process that never imports the model's code, at
batch sizes other than the one it was traced with; a model torch.export cannot capture fails with
an error naming the submodule and the construct; under MirroredStrategy(2) the chief writes one
artifact and both replicas serve the same numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from model_api_workers import Sequential, data, mirrored_api
from torch import nn

import stratagem as sg
from stratagem.testing import run_workers
from stratagem.train.export import ExportError
from stratagem.train.model_api import ModelAPI

Model = sg.Model if issubclass(sg.Model, ModelAPI) else type("Model", (ModelAPI, sg.Model), {})


class TwoHeads(Model):
    """A model whose code only this test module has: a dict output and a second method."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8))
        self.a = nn.Linear(8, 2)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = self.body(x)
        return {"a": self.a(h), "b": self.b(h).softmax(-1)}

    def embed(self, x):
        return self.body(x)


def _serve_in_fresh_process(path, inputs, tmp_path, code):
    """Run ``code`` (with ``loaded`` and ``x``) in a new interpreter that imports only stratagem."""
    torch.save(inputs, tmp_path / "x.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        import stratagem as sg
        loaded = sg.saved_model.load({str(path)!r})
        x = torch.load({str(tmp_path / 'x.pt')!r})
        {code}
        assert not any(m.startswith(("test_export", "model_api_workers")) for m in sys.modules), "model code imported"
        torch.save(out, {str(tmp_path / 'out.pt')!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=180, cwd=tmp_path,
                   capture_output=True, text=True)
    return torch.load(tmp_path / "out.pt")


@pytest.mark.slow
def test_model_export_round_trip_without_the_models_code(tmp_path, capsys):
    torch.manual_seed(0)
    model = TwoHeads()
    model.export(tmp_path / "served", sample_input=torch.randn(1, 4))  # a batch of 1: still dynamic
    printed = capsys.readouterr().out
    assert f"Saved artifact at '{tmp_path / 'served'}'. The following endpoints are available:" in printed
    assert "* Endpoint 'serve'" in printed and "TensorSpec(shape=(None, 4), dtype=torch.float32)" in printed
    manifest = json.loads((tmp_path / "served" / "saved_model.json").read_text())
    assert manifest["endpoints"]["serve"]["inputs"] == [{"shape": [None, 4], "dtype": "float32"}]
    assert manifest["signatures"] == {"serving_default": "serve"}
    assert sorted(p.name for p in (tmp_path / "served").iterdir()) == ["saved_model.json", "serve.pt2"]
    xs = [torch.randn(n, 4) for n in (1, 5, 17)]
    model.eval()
    with torch.no_grad():
        want = [model(x) for x in xs]
    got = _serve_in_fresh_process(
        tmp_path / "served", xs, tmp_path,
        "out = [(loaded.serve(v), loaded.signatures['serving_default'](v), loaded(v)) for v in x]",
    )
    for w, (served, signature, called) in zip(want, got):
        for out in (served, signature, called):
            assert sorted(out) == ["a", "b"]
            torch.testing.assert_close(out["a"], w["a"], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(out["b"], w["b"], rtol=1e-6, atol=1e-6)


def test_saved_model_save_with_signatures_and_a_single_output(tmp_path):
    torch.manual_seed(0)
    model = TwoHeads()
    sg.saved_model.save(model, tmp_path / "sm", signatures={"serve": model, "embed": model.embed},
                        sample_input=torch.randn(3, 4))
    seq = Sequential(nn.Linear(4, 3), nn.Tanh())
    sg.saved_model.save(seq, tmp_path / "seq", sample_input=np.zeros((2, 4), dtype=np.float64))  # numpy in
    x = torch.randn(6, 4)
    with torch.no_grad():
        want_embed, want_seq = model.embed(x), seq(x)
    e = sg.saved_model.load(tmp_path / "sm")
    s = sg.saved_model.load(tmp_path / "seq")
    assert sorted(e.signatures) == ["embed", "serving_default"]
    torch.testing.assert_close(e.embed(x), want_embed)
    torch.testing.assert_close(e.signatures["embed"](x)["output_0"], want_embed)
    torch.testing.assert_close(s.serve(x), want_seq)
    torch.testing.assert_close(s.signatures["serving_default"](x.numpy())["output_0"], want_seq)  # numpy in
    with pytest.raises(TypeError, match=r"options=\.\.\.\) takes stratagem.saved_model.SaveOptions"):
        sg.saved_model.save(seq, tmp_path / "x", options=object(), sample_input=x)
    local = sg.saved_model.SaveOptions(experimental_io_device="/job:localhost")  # TF's tutorial's
    sg.saved_model.save(seq, tmp_path / "io", options=local, sample_input=x)
    loaded = sg.saved_model.load(tmp_path / "io", options=sg.saved_model.LoadOptions(experimental_io_device="/job:localhost"))
    torch.testing.assert_close(loaded.serve(x), want_seq)
    with pytest.raises(FileNotFoundError, match="is not a saved model"):
        sg.saved_model.load(tmp_path)


def test_pt2_file_build_and_dynamic_batch_off(tmp_path):
    seq = Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    with pytest.raises(ValueError, match=r"needs a sample input .* or call model.build\(input_shape\) first"):
        seq.export(tmp_path / "none", verbose=False)
    seq.build((None, 4))  # Keras's build: export needs no sample input then
    seq.export(tmp_path / "m.pt2", verbose=False)
    program = torch.export.load(tmp_path / "m.pt2")
    x = torch.randn(9, 4)
    torch.testing.assert_close(program.module()(x), seq(x).detach())
    assert sg.saved_model.load(tmp_path / "m.pt2").serve(x).shape == (9, 1)
    seq.export(tmp_path / "fixed", sample_input=torch.randn(3, 4), dynamic_batch=False, verbose=False)
    fixed = sg.saved_model.load(tmp_path / "fixed")
    assert fixed.serve(torch.randn(3, 4)).shape == (3, 1)
    with pytest.raises(Exception, match="3"):
        fixed.serve(torch.randn(4, 4))
    with pytest.raises(ValueError, match="format='onnx' is not offered"):
        seq.export(tmp_path / "o", format="onnx")


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # a branch on a tensor's value
            return x
        return -x


class Gated(Model):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.proj(x))


def test_an_unexportable_model_names_the_module_and_the_construct(tmp_path):
    with pytest.raises(ExportError) as info:
        Gated().export(tmp_path / "g", sample_input=torch.randn(2, 4), verbose=False)
    text = str(info.value)
    assert text.startswith("export: Gated cannot be exported by torch.export in module gate (Gate):")
    assert "data-dependent" in text and "if x.sum() > 0:" in text and "test_export.py" in text
    assert "torch.where or torch.cond" in text
    assert not (tmp_path / "g").exists()


class FixedBatch(Model):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 2)

    def forward(self, x):
        return self.proj(x).reshape(4, 1)  # the batch of 2 written into the model


def test_a_model_that_fixes_the_batch_size_says_so(tmp_path):
    with pytest.raises(ExportError, match=r"(?s)Constraints violated \(batch\).*specialized it to be a constant \(2\)"
                       r".*make it follow x.shape\[0\], or export with dynamic_batch=False"):
        FixedBatch().export(tmp_path / "f", sample_input=torch.randn(2, 4), verbose=False)
    FixedBatch().export(tmp_path / "f", sample_input=torch.randn(2, 4), verbose=False, dynamic_batch=False)
    assert sg.saved_model.load(tmp_path / "f").serve(torch.randn(2, 4)).shape == (4, 1)


def test_export_under_mirrored_strategy_writes_one_artifact(tmp_path):
    """summary, get_weights and export on both replicas of MirroredStrategy(2): the same summary and
    weights on each, one file set written (by the chief), served numbers equal the model's; a
    frozen layer stays put through the replicas' fit."""
    results = [r.value for r in run_workers(mirrored_api, 2, args=(str(tmp_path),), timeout=240)]
    a, b = results
    assert a["summary"] == b["summary"] and " Total params: " in a["summary"]
    assert "│ 0 (Linear)" in a["summary"] and "(None, 8)" in a["summary"]
    for wa, wb in zip(a["weights"], b["weights"]):
        np.testing.assert_array_equal(wa, wb)
    for r in results:
        for k in ("0.weight", "0.bias"):  # frozen for the last epoch
            assert torch.equal(r["after"][k], r["before"][k]), k
        for k in ("2.weight", "2.bias"):
            assert not torch.equal(r["after"][k], r["before"][k]), k
            torch.testing.assert_close(r["after"][k], a["after"][k], rtol=0, atol=0)  # one model
        torch.testing.assert_close(r["served"], r["model"])
        torch.testing.assert_close(r["saved"], r["model"][:7])
        torch.testing.assert_close(r["run"], r["model"])
    for name in ("served", "saved"):
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["saved_model.json", "serve.pt2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved", "served"]  # no staging left behind
    x, _ = data()
    served = sg.saved_model.load(tmp_path / "served")
    torch.testing.assert_close(served.serve(x), a["model"])
