"""One process per replica, where users meet it (issue 30, item 4).

TensorFlow runs a MirroredStrategy program in one process that holds every replica; stratagem
runs the script once per replica. These tests write TensorFlow's own code (the distributed-input
tutorial, its ``experimental_distribute_values_from_function`` example) and check that it gets
TensorFlow's answer: ``experimental_local_results`` gives every local replica's part,
``PerReplica`` prints as tf prints it, ``sg.print`` / ``is_chief`` / ``main_process_first``
run code once, TensorFlow's device strings name devices, and ``nn.Lazy*`` models made in the
scope are mirrored like any other.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.distribute.devices import plan_devices, torch_device_name
from stratagem.testing import assert_matches_single_device, run_workers
from stratagem.testing.contracts import assert_replicas_identical, train_under

# --- experimental_local_results, PerReplica, sg.print, is_chief, main_process_first ----------


def tutorial_worker(tmp: str) -> dict:
    # TF: mirrored_strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]) style devices
    mirrored_strategy = sg.MirroredStrategy(devices=["/cpu:0", "/cpu:0"])
    out: dict = {"devices": list(mirrored_strategy.devices)}

    # tensorflow.org/tutorials/distribute/input, "Preprocessing ... ordering of the outputs"
    dataset_size = 24
    batch_size = 6
    dataset = sg.data.Dataset.range(dataset_size).enumerate().batch(batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    def predict(index, inputs):
        outputs = 2 * inputs
        return index, outputs

    result = {}
    for index, inputs in dist_dataset:
        output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
        indices = list(mirrored_strategy.experimental_local_results(output_index))
        rindices = []
        for a in indices:
            rindices.extend(a.numpy())
        outputs = list(mirrored_strategy.experimental_local_results(outputs))
        routputs = []
        for a in outputs:
            routputs.extend(a.numpy())
        for i, value in zip(rindices, routputs):
            result[i] = value
    out["result"] = {int(k): int(v) for k, v in result.items()}

    # the same tutorial, experimental_distribute_values_from_function
    def value_fn(ctx):
        return torch.tensor(ctx.replica_id_in_sync_group)

    distributed_values = mirrored_strategy.experimental_distribute_values_from_function(value_fn)
    out["values"] = [int(v) for v in mirrored_strategy.experimental_local_results(distributed_values)]
    # a reduced value is one value for the job (a plain tensor in tf): one part
    total = mirrored_strategy.reduce("sum", distributed_values, axis=None)
    out["reduced_parts"] = len(mirrored_strategy.experimental_local_results(total))
    # nested per-replica values keep their structure, part by part
    nested = mirrored_strategy.run(lambda: {"x": torch.ones(2) * (mirrored_strategy.extended.replica_id + 1)})
    out["nested"] = [p["x"].tolist() for p in mirrored_strategy.experimental_local_results(nested)]

    # merge_call's PerReplica prints as tf prints a distributed value
    def replica_fn():
        ctx = sg.get_replica_context()
        return ctx.merge_call(lambda s, v: (str(v), repr(v)), args=(torch.tensor(ctx.replica_id_in_sync_group),))

    out["printed"] = mirrored_strategy.run(replica_fn)

    # Accelerate's helpers: printed once, on the chief
    sg.print("printed once:", mirrored_strategy.experimental_local_results(distributed_values))
    out["is_chief"] = (mirrored_strategy.is_chief, sg.is_chief())
    with mirrored_strategy.scope():
        out["is_chief_in_scope"] = sg.is_chief()
    # main_process_first: the chief prepares the data while the others wait, then they read it
    cache = Path(tmp, "prepared.txt")
    with mirrored_strategy.main_process_first():
        if not cache.exists():
            time.sleep(0.5)  # a slow download
            cache.write_text(f"prepared by rank {mirrored_strategy.extended.replica_id}")
        out["cache"] = cache.read_text()
    return out


@pytest.mark.timeout(180)
def test_tensorflow_input_tutorial_collects_every_prediction(tmp_path):
    results = [r for r in run_workers(tutorial_worker, 2, args=(str(tmp_path),))]
    for rank, r in enumerate(results):
        res = r.value
        assert res["devices"] == ["cpu", "cpu"]
        # TF's single process prints {0: 0, 1: 2, ..., 23: 46}: all 24, not this replica's 12
        assert res["result"] == {i: 2 * i for i in range(24)}
        assert res["values"] == [0, 1]
        assert res["reduced_parts"] == 1
        assert res["nested"] == [[1.0, 1.0], [2.0, 2.0]]
        assert res["printed"] == ("PerReplica:{\n  0: tensor(0),\n  1: tensor(1)\n}",) * 2
        assert res["is_chief"] == (rank == 0, rank == 0)
        assert res["is_chief_in_scope"] == (rank == 0)
        assert res["cache"] == "prepared by rank 0"
    assert "printed once: (tensor(0), tensor(1))" in results[0].stdout
    assert "printed once" not in results[1].stdout


def misuse_worker() -> str:
    strategy = sg.MirroredStrategy("cpu", num_replicas=2)
    value = strategy.run(lambda: torch.tensor(strategy.extended.replica_id))
    try:
        if strategy.is_chief:  # the others never make this call: they make the next one
            strategy.experimental_local_results(value)
        else:
            strategy.experimental_local_results(value)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_local_results_called_at_different_points_is_a_clear_error():
    for r in run_workers(misuse_worker, 2):
        assert "every replica must call it at the same point" in r.value
        assert "not inside `if strategy.is_chief:`" in r.value


def multi_worker_worker() -> list:
    from stratagem.cluster_resolver import TorchrunClusterResolver

    strategy = sg.MultiWorkerMirroredStrategy(TorchrunClusterResolver(), devices="cpu")
    value = strategy.run(lambda: torch.tensor([strategy.extended.replica_id]))
    # tf multi-worker: each worker holds its own replicas only (one per process here)
    return [t.tolist() for t in strategy.experimental_local_results(value)]


@pytest.mark.timeout(120)
def test_multi_worker_local_results_are_this_workers_only():
    assert [r.value for r in run_workers(multi_worker_worker, 2)] == [[[0]], [[1]]]


def test_per_replica_prints_as_tensorflow_does():
    v = sg.distribute.PerReplica((torch.tensor(1.0), torch.tensor(2.0)))
    assert str(v) == "PerReplica:{\n  0: tensor(1.),\n  1: tensor(2.)\n}"
    assert repr(sg.distribute.PerReplica(("a", "b"))) == "PerReplica:{\n  0: 'a',\n  1: 'b'\n}"
    assert sg.get_strategy().experimental_local_results(v) == v.values


def test_one_process_helpers_without_a_job(capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    strategy = sg.OneDeviceStrategy("/cpu:0")
    assert strategy.is_chief and sg.is_chief()
    sg.print("once", 1)
    with strategy.main_process_first():
        sg.print("inside")
    assert capsys.readouterr().out == "once 1\ninside\n"
    assert strategy.experimental_local_results(torch.tensor(3.0)) == (torch.tensor(3.0),)


# --- TensorFlow's device strings ------------------------------------------------------------

TF_DEVICES = [
    ("/gpu:0", "cuda:0"),
    ("/GPU:1", "cuda:1"),
    ("/device:GPU:0", "cuda:0"),
    ("GPU:2", "cuda:2"),
    ("/job:worker/replica:0/task:0/device:GPU:0", "cuda:0"),
    ("/job:localhost/replica:0/task:0/device:CPU:0", "cpu"),
    ("/cpu:0", "cpu"),
    ("/device:CPU:0", "cpu"),
    ("cuda:1", "cuda:1"),
    ("cpu", "cpu"),
]


@pytest.mark.parametrize(("tf_name", "torch_name"), TF_DEVICES)
def test_tensorflow_device_names_map_to_torch_devices(tf_name, torch_name):
    assert torch_device_name(tf_name) == torch_name


def test_device_plans_from_tensorflow_names():
    assert plan_devices(["/gpu:0", "/gpu:1"], None, 2, what="MirroredStrategy") == ["cuda:0", "cuda:1"]
    assert plan_devices(["/cpu:0", "/cpu:0"], None, 0, what="MirroredStrategy") == ["cpu", "cpu"]
    assert plan_devices("/cpu:0", 3, 0, what="MirroredStrategy") == ["cpu"] * 3
    with pytest.raises(ValueError, match=r"device '/gpu:0' \(cuda:0\) of replica 0 is not available: this machine has no GPU; use '/cpu:0'"):
        plan_devices(["/gpu:0", "/gpu:1"], None, 0, what="MirroredStrategy")
    with pytest.raises(ValueError, match=r"device '/device:GPU:1' \(cuda:1\) of replica 1 is not available: this machine has 1 GPU"):
        plan_devices(["/device:GPU:0", "/device:GPU:1"], None, 1, what="MirroredStrategy")
    with pytest.raises(ValueError, match="names a device of task 1"):
        plan_devices(["/job:worker/replica:0/task:1/device:GPU:0"], None, 2, what="MirroredStrategy")
    with pytest.raises(ValueError, match="TPUStrategy"):
        plan_devices(["/device:TPU:0"], None, 0, what="MirroredStrategy")
    with pytest.raises(ValueError, match="unknown device 'npu:0'"):
        plan_devices(["npu:0"], None, 0, what="MirroredStrategy")


def test_one_device_strategy_takes_tensorflow_names():
    assert sg.OneDeviceStrategy("/cpu:0").device == torch.device("cpu")
    assert sg.OneDeviceStrategy("/job:localhost/replica:0/task:0/device:CPU:0").device == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"OneDeviceStrategy\('/gpu:0'\): asks for a GPU, but CUDA is not available.*use '/cpu:0'"):
            sg.OneDeviceStrategy("/gpu:0")
    else:
        assert sg.OneDeviceStrategy("/gpu:0").device == torch.device("cuda:0")


# --- nn.Lazy* modules made in the scope ------------------------------------------------------


def make_lazy_model() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.LazyLinear(3))


def make_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def per_example(logits, y):
    return nn.functional.cross_entropy(logits, y, reduction="none")


def global_batches(sizes):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def lazy_worker(compiled: bool) -> dict:
    strategy = sg.MirroredStrategy("cpu", num_replicas=2)
    rank = strategy.extended.replica_id
    batches = global_batches([8, 8, 6])
    if not compiled:  # materialized at the first strategy.run: one device's answer on the global batch
        assert_matches_single_device(strategy, make_lazy_model, make_sgd, per_example, batches)
    else:
        # torch.compile materializes lazy modules while tracing and restores the RNG around
        # each traced frame, so a compiled step initializes differently from an eager one (on
        # one device too): compare with the compiled step on one device
        model, _ = train_under(strategy, make_lazy_model, make_sgd, per_example, batches, wrap_step=functools.partial(sg.function, jit_compile=True))
        assert_replicas_identical(strategy, model)
        one, _ = train_under(sg.OneDeviceStrategy("cpu"), make_lazy_model, make_sgd, per_example, batches, wrap_step=functools.partial(sg.function, jit_compile=True))
        for (name, got), want in zip(model.state_dict().items(), one.state_dict().values()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)

    # every replica initializes differently; the dry run in the scope makes them rank 0's
    torch.manual_seed(rank)
    with strategy.scope():
        model = nn.Sequential(nn.LazyLinear(8), nn.LazyBatchNorm1d(), nn.LazyLinear(3))
        # Keras: model.build / a first call, on the same batch everywhere (BatchNorm's statistics move)
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(7)))
    assert_replicas_identical(strategy, model)
    return {"owner": sg.strategy_of(model) is strategy, "in_features": model[0].in_features}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("compiled", [
    False,
    pytest.param(True, marks=pytest.mark.slow),  # compiling takes ~25 s here: in the slow tier
], ids=["eager", "function"])
def test_lazy_modules_made_in_scope_are_mirrored(compiled):
    for r in run_workers(lazy_worker, 2, args=(compiled,)):
        assert r.value == {"owner": True, "in_features": 5}


def test_lazy_module_outside_the_scope_is_refused_with_its_name():
    strategy = sg.OneDeviceStrategy("cpu")
    model = nn.LazyLinear(3)
    with pytest.raises(sg.OutsideScopeError, match=r"LazyLinear \(parameter 'weight', shape uninitialized \(lazy\)\) was created outside"):
        strategy.run(model, args=(torch.zeros(2, 4),))


