"""The count-based metrics (issue 50): AUC, Precision, Recall, F1Score / FBetaScore, IoU / MeanIoU,
top-k accuracies and torchmetrics objects, by name and as objects, with Keras 3's numbers (Keras
itself on its torch backend is the oracle: several batches, sample weights, the edge cases of its
thresholds), and exact across replicas: their state is confusion counts summed across replicas,
so MirroredStrategy(2) gives the one-device value."""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from confusion_metrics_workers import custom_loop, data, mirrored_program, program  # noqa: E402
from torch import nn  # noqa: E402

import stratagem as sg  # noqa: E402
from stratagem.testing import run_workers  # noqa: E402

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:keras")
if keras.backend.backend() != "torch":  # pragma: no cover - another backend chosen by the caller
    pytest.skip("these tests compare with Keras on its torch backend", allow_module_level=True)

CUTS = [0, 37, 87, 100, 150]  # four batches of different sizes


def _binary(n: int = 150) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    y = (rng.random((n, 1)) < 0.4).astype("float32")
    p = rng.random((n, 1)).astype("float32")
    # Keras's bucket edges and thresholds: 0, 1, 0.5, i / 199, a third
    p[:10, 0] = np.array([0, 1, 0.5, 1 / 199, 2 / 199, 198 / 199, 0.3, 0.7, 1 / 3, 0.25], dtype="float32")
    return y, p


def _multilabel(n: int = 150) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(2)
    y = (rng.random((n, 4)) < 0.3).astype("float32")
    p = rng.random((n, 4)).astype("float32")
    p[:5] = 0.25  # ties for top_k
    return y, p


def _weights(n: int = 150) -> np.ndarray:
    return (np.random.default_rng(3).random(n) * 3).astype("float32")


def _classes(n: int = 150) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(1)
    y = rng.integers(0, 4, (n,)).astype("int64")
    y[:5] = [-1, 7, 2, 255, 3]  # out of range ids count for nothing (Keras's bounds mask)
    p = rng.integers(0, 4, (n,)).astype("int64")
    probs = rng.random((n, 4)).astype("float32")
    probs[:6] = 0.25  # ties: Keras's in_top_k counts a tie with the k-th as in the top k
    return y, p, probs


def _run(make, y, p, sample_weight):
    ours, theirs = make(sg.metrics), make(keras.metrics)
    for a, b in zip(CUTS, CUTS[1:]):
        kw = {} if sample_weight is None else {"sample_weight": sample_weight[a:b]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MeanIoU's "float weights for an int dtype" warning, both sides
            theirs.update_state(y[a:b], p[a:b], **kw)
            ours.update_state(torch.from_numpy(y[a:b]), torch.from_numpy(p[a:b]),
                              **{k: torch.from_numpy(v) for k, v in kw.items()})
    return (np.asarray(ours.result(), dtype=np.float64),
            np.asarray(keras.ops.convert_to_numpy(theirs.result()), dtype=np.float64), ours)


BINARY = {
    "auc_roc": lambda ns: ns.AUC(),
    "auc_pr": lambda ns: ns.AUC(curve="PR"),
    "auc_roc_minoring": lambda ns: ns.AUC(summation_method="minoring"),
    "auc_pr_majoring": lambda ns: ns.AUC(curve="PR", summation_method="majoring"),
    "auc_prgain": lambda ns: ns.AUC(curve="PRGAIN"),
    "auc_50_thresholds": lambda ns: ns.AUC(num_thresholds=50),
    "auc_given_thresholds": lambda ns: ns.AUC(thresholds=[0.1, 0.35, 0.8]),  # not even: compared, not bucketed
    "auc_given_even_thresholds": lambda ns: ns.AUC(thresholds=[0.25, 0.5, 0.75], curve="PR"),
    "precision": lambda ns: ns.Precision(),
    "precision_thresholds": lambda ns: ns.Precision(thresholds=[0.3, 0.5, 0.7]),
    "precision_even_thresholds": lambda ns: ns.Precision(thresholds=[0.0, 0.5, 1.0]),  # bucketed, no epsilon
    "recall": lambda ns: ns.Recall(),
    "recall_thresholds": lambda ns: ns.Recall(thresholds=[0.2, 0.5]),
    "true_positives": lambda ns: ns.TruePositives(),
    "false_positives": lambda ns: ns.FalsePositives(thresholds=[0.1, 0.9]),
    "true_negatives": lambda ns: ns.TrueNegatives(thresholds=[0.1, 0.9]),
    "false_negatives": lambda ns: ns.FalseNegatives(),
}
MULTILABEL = {
    "auc_multi_label": lambda ns: ns.AUC(multi_label=True, num_labels=4),
    "auc_multi_label_lazy_pr_weighted": lambda ns: ns.AUC(multi_label=True, curve="PR", label_weights=[1, 2, 0.5, 1]),
    "auc_flattened_label_weights": lambda ns: ns.AUC(label_weights=[1, 2, 0.5, 1]),
    "precision_top_k": lambda ns: ns.Precision(top_k=2),
    "precision_class_id": lambda ns: ns.Precision(class_id=1),
    "recall_top_k_class_id": lambda ns: ns.Recall(top_k=2, class_id=1),
    "recall_top_k_thresholds": lambda ns: ns.Recall(top_k=1, thresholds=[0.2, 0.6]),
    "f1": lambda ns: ns.F1Score(),
    "f1_micro": lambda ns: ns.F1Score(average="micro", threshold=0.5),
    "f1_macro": lambda ns: ns.F1Score(average="macro"),
    "f1_weighted": lambda ns: ns.F1Score(average="weighted", threshold=0.4),
    "fbeta_macro": lambda ns: ns.FBetaScore(beta=2.0, average="macro"),
    "fbeta_none": lambda ns: ns.FBetaScore(beta=0.5, threshold=0.3),
}


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("name", sorted(BINARY) + sorted(MULTILABEL))
def test_confusion_metrics_give_keras_numbers(name, weighted):
    y, p = _binary() if name in BINARY else _multilabel()
    got, want, _ = _run((BINARY | MULTILABEL)[name], y, p, _weights() if weighted else None)
    assert got.shape == want.shape
    # Keras counts in float32, stratagem in float64: counts agree to float32's relative rounding
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _iou(ns, **kw):
    return ns.MeanIoU(4, **kw)


CLASSES = {
    "mean_iou": (lambda ns: ns.MeanIoU(4), "ids"),
    "mean_iou_ignore_class": (lambda ns: ns.MeanIoU(4, ignore_class=2), "ids"),
    "mean_iou_dense_predictions": (lambda ns: ns.MeanIoU(4, sparse_y_pred=False), "probs"),
    "mean_iou_float_dtype": (lambda ns: ns.MeanIoU(4, dtype="float32", sparse_y_pred=False), "probs"),
    "iou_targets": (lambda ns: ns.IoU(4, [0, 2]), "ids"),
    "sparse_top_k": (lambda ns: ns.SparseTopKCategoricalAccuracy(k=2), "probs"),
    "sparse_top_1": (lambda ns: ns.SparseTopKCategoricalAccuracy(k=1), "probs"),
    "sparse_top_k_sorted_ids": (lambda ns: ns.SparseTopKCategoricalAccuracy(k=2, from_sorted_ids=True), "sorted"),
    "top_k_one_hot": (lambda ns: ns.TopKCategoricalAccuracy(k=2), "probs"),
}


@pytest.mark.parametrize("weights", ["none", "integer", "float"])
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_iou_and_top_k_give_keras_numbers(name, weights):
    y, ids, probs = _classes()
    make, kind = CLASSES[name]
    p = {"ids": ids, "probs": probs, "sorted": np.argsort(-probs, -1).astype("int64")}[kind]
    if "iou" not in name:
        y = np.clip(y, 0, 3)
    if name == "top_k_one_hot":
        y = np.eye(4, dtype="float32")[y]
    rng = np.random.default_rng(4)
    sw = {"none": None, "integer": rng.integers(0, 3, 150).astype("float32"),
          "float": (rng.random(150) * 3).astype("float32")}[weights]
    got, want, _ = _run(make, y, p, sw)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_counts_are_sums_so_any_split_of_the_batches_gives_the_same_totals():
    y, p = _binary()
    sw = _weights()
    for make in (lambda: sg.metrics.AUC(), lambda: sg.metrics.Precision(thresholds=[0.3, 0.5]),
                 lambda: sg.metrics.F1Score(threshold=0.5)):
        whole, parts = make(), make()
        yy = y if not isinstance(whole, sg.metrics.F1Score) else np.concatenate([y, 1 - y], 1)
        pp = p if not isinstance(whole, sg.metrics.F1Score) else np.concatenate([p, 1 - p], 1)
        whole.update_state(torch.from_numpy(yy), torch.from_numpy(pp), sample_weight=torch.from_numpy(sw))
        for a, b in [(0, 1), (1, 60), (60, 60), (60, 150)]:  # an empty batch counts for nothing
            parts.update_state(torch.from_numpy(yy[a:b]), torch.from_numpy(pp[a:b]),
                               sample_weight=torch.from_numpy(sw[a:b]))
        torch.testing.assert_close(whole.global_totals(), parts.global_totals(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(whole.result(), parts.result(), rtol=1e-12, atol=1e-12)
        parts.reset_state()
        assert float(parts.global_totals().abs().sum()) == 0.0


def test_names_are_keras_names():
    for name, cls, logs in [("auc", sg.metrics.AUC, "auc"), ("AUC", sg.metrics.AUC, "auc"),
                            ("precision", sg.metrics.Precision, "precision"), ("recall", sg.metrics.Recall, "recall"),
                            ("f1_score", sg.metrics.F1Score, "f1_score"), ("F1Score", sg.metrics.F1Score, "f1_score"),
                            ("FBetaScore", sg.metrics.FBetaScore, "fbeta_score"),
                            ("sparse_top_k_categorical_accuracy", sg.metrics.SparseTopKCategoricalAccuracy,
                             "sparse_top_k_categorical_accuracy")]:
        m = sg.metrics.get(name)
        assert type(m) is cls and m.name == logs
        assert type(keras.metrics.get(name)).__name__ == cls.__name__  # the names Keras takes
    for name in ("fbeta_score", "mean_iou", "f1"):  # Keras refuses these names: so does stratagem
        with pytest.raises(ValueError):
            keras.metrics.get(name)
        with pytest.raises(ValueError, match="unknown metric"):
            sg.metrics.get(name)
    assert sg.metrics.MeanIoU(3).name == "mean_io_u" and keras.metrics.MeanIoU(3).name.startswith("mean_io_u")
    assert [m.name for m in sg.train.metrics.compile_metrics(["auc", "AUC"], ["auc"])] == ["auc", "AUC", "weighted_auc"]


def _keras_pair():
    keras.utils.set_random_seed(0)
    km = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1, activation="sigmoid")])
    model = sg.Sequential(nn.Linear(5, 1), nn.Sigmoid())
    with torch.no_grad():
        k, b = km.layers[0].get_weights()
        model[0].weight.copy_(torch.from_numpy(k.T))
        model[0].bias.copy_(torch.from_numpy(b))
    return km, model


def test_compile_auc_precision_recall_fit_and_evaluate_give_keras_history():
    x, y, sw = data()
    km, model = _keras_pair()
    runs = []
    for m, opt in [(km, keras.optimizers.SGD(0.1)), (model, sg.optimizers.SGD(0.1))]:
        m.compile(optimizer=opt, loss="binary_crossentropy", metrics=["auc", "precision", "recall"],
                  weighted_metrics=["auc", "AUC"])
        h = m.fit(x, y, sample_weight=sw, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  validation_data=(x[:40], y[:40]))
        ev = m.evaluate(x, y, sample_weight=sw, batch_size=32, verbose=0, return_dict=True)
        runs.append((h.history, ev))
    (kh, ke), (sh, se) = runs
    assert {"auc", "precision", "recall", "weighted_auc", "AUC", "val_auc", "val_weighted_auc"} <= set(kh)
    assert sorted(sh) == sorted(kh)
    for key in kh:
        np.testing.assert_allclose(sh[key], kh[key], rtol=2e-6, atol=2e-6, err_msg=key)
    assert list(se) == list(ke)
    np.testing.assert_allclose(list(se.values()), [float(v) for v in ke.values()], rtol=2e-6, atol=2e-6)
    assert sh["auc"] != sh["weighted_auc"]  # the weights do change the weighted one


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_fit_and_evaluate_under_mirrored_strategy_equal_one_device():
    pytest.importorskip("torchmetrics")
    want = program(sg.OneDeviceStrategy("cpu"))
    assert {"auc", "precision", "recall", "pr_auc", "f1_score", "binary_auroc", "binary_accuracy", "weighted_auc",
            "precision_at_04", "val_auc"} <= set(want["history"])
    got = [r.value for r in run_workers(mirrored_program, 2, timeout=240)]
    for g in got:
        assert list(g["history"]) == list(want["history"])
        for key in want["history"]:  # fit: the weights agree to float rounding of the reduced gradients
            np.testing.assert_allclose(g["history"][key], want["history"][key], rtol=1e-6, atol=1e-6, err_msg=key)
        assert list(g["evaluate"]) == list(want["evaluate"])
        for key, value in want["evaluate"].items():  # the same weights: the very counts of one device
            if key != "loss":
                assert g["evaluate"][key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
            else:
                assert g["evaluate"][key] == pytest.approx(value, rel=1e-6)


@pytest.mark.timeout(200)
def test_metrics_updated_in_strategy_run_sum_every_replicas_counts():
    got = [r.value for r in run_workers(custom_loop, 2, timeout=150)]
    _, y, sw = data()
    probs = np.array(got[0]["probs"], dtype=np.float32)
    made = [sg.metrics.AUC(), sg.metrics.AUC(curve="PR"), sg.metrics.Precision(), sg.metrics.Recall(),
            sg.metrics.F1Score(average="micro", threshold=0.5), sg.metrics.MeanIoU(2)]
    for m in made[:-1]:
        m.update_state(torch.from_numpy(y), torch.from_numpy(probs), sample_weight=torch.from_numpy(sw))
    made[-1].update_state(torch.from_numpy(y).long(), torch.from_numpy(probs > 0.5).long())
    for g in got:
        for m, value, totals in zip(made, g["results"], g["totals"]):
            torch.testing.assert_close(torch.tensor(totals, dtype=torch.float64), m.global_totals(),
                                       rtol=1e-12, atol=1e-12)
            assert value == pytest.approx(float(m.result()), rel=1e-12, abs=1e-12)
    k = keras.metrics.AUC()
    k.update_state(y, probs, sample_weight=sw)
    assert got[0]["results"][0] == pytest.approx(float(k.result()), abs=1e-6)


def test_torchmetrics_objects_in_metrics():
    torchmetrics = pytest.importorskip("torchmetrics")
    from torchmetrics.classification import BinaryAUROC, MulticlassF1Score

    x, y, _ = data()
    model = sg.Sequential(nn.Linear(5, 1), nn.Sigmoid())
    model.compile(optimizer=sg.optimizers.SGD(0.1), loss="binary_crossentropy",
                  metrics=[BinaryAUROC(thresholds=200), torchmetrics.MeanSquaredError(), "auc"])
    ev = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    with torch.no_grad():
        p = model(torch.from_numpy(x))
    ref = BinaryAUROC(thresholds=200)
    ref.update(p, torch.from_numpy(y).long())
    assert ev["binary_auroc"] == pytest.approx(float(ref.compute()), abs=1e-7)
    assert ev["mean_squared_error"] == pytest.approx(float(((p - torch.from_numpy(y)) ** 2).mean()), rel=1e-6)
    assert abs(ev["binary_auroc"] - ev["auc"]) < 1e-2  # torchmetrics' thresholds are not Keras's, nearly
    f1 = sg.metrics.get(MulticlassF1Score(3, average="macro"))
    labels, logits = torch.tensor([0, 1, 2, 2, 1]), torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    f1.update_state(labels[:2], logits[:2])
    f1.update_state(labels[2:], logits[2:])
    ref_f1 = MulticlassF1Score(3, average="macro")
    ref_f1.update(logits, labels)
    assert float(f1.result()) == pytest.approx(float(ref_f1.compute()))
    with pytest.raises(ValueError, match=r"'preds' is reduced by 'cat'.*BinaryAUROC\(thresholds=200\)"):
        sg.metrics.get(BinaryAUROC())
    with pytest.raises(ValueError, match="takes no sample weights"):
        model.compile(optimizer="sgd", loss="binary_crossentropy", weighted_metrics=[BinaryAUROC(thresholds=10)])
        model.evaluate(x, y, sample_weight=np.ones(90, "float32"), batch_size=16, verbose=0)
    tm = BinaryAUROC(thresholds=10)
    with pytest.raises(ValueError, match="given twice"):
        sg.train.metrics.compile_metrics([tm], [tm])


def test_clear_errors():
    with pytest.raises(ValueError, match="Invalid AUC curve"):
        sg.metrics.AUC(curve="DET")
    with pytest.raises(ValueError, match="Threshold values must be in"):
        sg.metrics.Precision(thresholds=[0.5, 1.5])
    with pytest.raises(ValueError, match="class_id is provided"):
        sg.metrics.Precision(class_id=0).update_state(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="2D inputs"):
        sg.metrics.F1Score().update_state(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="does not broadcast"):
        sg.metrics.AUC().update_state(torch.ones(4, 1), torch.ones(4, 1), sample_weight=torch.ones(3))
    with pytest.raises(ValueError, match="out of range"):
        sg.metrics.IoU(3, [3])
