"""TFConfigClusterResolver answers as TensorFlow's: TF_CONFIG's task as given, tf's master(),
cluster_spec() and num_accelerators(); the multi-worker Keras tutorial's save-on-chief logic
keeps the chief's model, with and without a 'chief' job in TF_CONFIG."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.cluster.resolvers import (
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    detect,
)
from stratagem.testing import run_workers

WORKERS = ["10.0.0.2:2222", "10.0.0.3:2222"]


def tf_config(task_type, index, chief=False, **extra):
    cluster = {"chief": ["10.0.0.1:2222"], "worker": WORKERS} if chief else {"worker": WORKERS}
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, **extra})}


def local_gpus():
    return {"GPU": torch.cuda.device_count()} if torch.cuda.is_available() and torch.cuda.device_count() else {}


@pytest.mark.parametrize(
    "chief,task_type,index,rank,master",
    [
        (False, "worker", 0, 0, "10.0.0.2:2222"),
        (False, "worker", 1, 1, "10.0.0.3:2222"),
        (True, "chief", 0, 0, "10.0.0.1:2222"),
        (True, "worker", 0, 1, "10.0.0.2:2222"),
        (True, "worker", 1, 2, "10.0.0.3:2222"),
    ],
)
def test_task_type_and_id_are_tf_configs_task(chief, task_type, index, rank, master):
    resolver = TFConfigClusterResolver(tf_config(task_type, index, chief))
    assert (resolver.task_type, resolver.task_id) == (task_type, index)  # tf: TF_CONFIG's task as given
    assert resolver.master() == master  # tf: this task's address
    assert resolver.master(rpc_layer="grpc") == "grpc://" + master
    assert resolver.master("worker", 1) == "10.0.0.3:2222"
    assert resolver.num_accelerators() == local_gpus()
    spec = resolver.cluster_spec()
    jobs = {"chief": ["10.0.0.1:2222"], "worker": WORKERS} if chief else {"worker": WORKERS}
    assert spec.as_dict() == jobs and spec.jobs == list(jobs)
    assert spec.num_tasks("worker") == 2 and spec.task_indices("worker") == [0, 1]
    assert spec.task_address("worker", 1) == "10.0.0.3:2222" and spec.job_tasks("worker") == WORKERS
    with pytest.raises(ValueError, match="No such job in cluster: 'ps'"):
        spec.num_tasks("ps")
    # stratagem's own order (the chief job first) is kept apart: it decides the rendezvous
    assert (spec.rank, spec.world_size, spec.is_chief) == (rank, len(jobs.get("chief", [])) + 2, rank == 0)
    assert spec.master == ("10.0.0.1:2222" if chief else "10.0.0.2:2222")


def test_master_rpc_layer_session_master_and_setters_as_tf():
    resolver = TFConfigClusterResolver(tf_config("worker", 1, rpc_layer="grpc"))
    assert resolver.rpc_layer == "grpc" and resolver.master() == "grpc://10.0.0.3:2222"
    assert TFConfigClusterResolver(tf_config("worker", 0, session_master="s:1")).master() == "s:1"
    alone = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}})}
    assert TFConfigClusterResolver(alone).master() == ""  # tf: one job of one task
    resolver.task_type, resolver.task_id = "worker", 0  # tf's setters
    assert (resolver.task_type, resolver.task_id, resolver.master()) == ("worker", 0, "grpc://10.0.0.2:2222")
    assert resolver.cluster_spec().rank == 1  # the process's place in the job does not move


def test_ps_cluster_master_is_this_tasks_address():
    cluster = {"chief": ["10.0.0.1:2222"], "worker": WORKERS, "ps": ["10.0.0.4:2222"]}
    env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}})}
    resolver = TFConfigClusterResolver(env)
    assert (resolver.task_type, resolver.task_id, resolver.master()) == ("ps", 0, "10.0.0.4:2222")
    assert resolver.ps_cluster().chief == "10.0.0.1:2222"  # the rendezvous


def test_other_resolvers_report_each_process_as_a_worker_task():
    # tf's SlurmClusterResolver: every task a 'worker', its index the task's rank; so the
    # tutorial's `_is_chief` (worker 0) picks exactly one process under any launcher
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "1", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29500"}
    assert (TorchrunClusterResolver(torchrun).task_type, TorchrunClusterResolver(torchrun).task_id) == ("worker", 3)
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_NODEID": "2"}
    assert (SlurmClusterResolver(slurm).task_type, SlurmClusterResolver(slurm).task_id) == ("worker", 5)
    alone = detect({})
    assert (alone.task_type, alone.task_id) == (None, None)  # tf, without TF_CONFIG


# --- the multi-worker Keras tutorial's "Model saving and loading", as written ------------------


def make_model():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(4)]


def train(strategy):
    with strategy.scope():
        torch.manual_seed(0)
        multi_worker_model = make_model()
        optimizer = torch.optim.SGD(multi_worker_model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss(reduction="none")

    def step(x, y):
        optimizer.zero_grad()
        loss = sg.compute_average_loss(loss_fn(multi_worker_model(x), y))
        loss.backward()
        optimizer.step()

    for x, y in strategy.experimental_distribute_dataset(batches()):
        strategy.run(step, args=(x, y))
    return multi_worker_model


def tutorial_worker(with_chief: bool, model_dir: str) -> tuple:
    rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    addresses = [f"127.0.0.1:{port + i}" for i in range(3 if with_chief else 2)]  # only the first is dialled
    if with_chief:
        cluster = {"chief": addresses[:1], "worker": addresses[1:]}
        task = {"type": "chief", "index": 0} if rank == 0 else {"type": "worker", "index": rank - 1}
    else:
        cluster, task = {"worker": addresses}, {"type": "worker", "index": rank}
    os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": task})

    strategy = sg.MultiWorkerMirroredStrategy()
    multi_worker_model = train(strategy)

    model_path = os.path.join(model_dir, "keras-model")

    if with_chief:
        def _is_chief(task_type, task_id):
            # the tutorial: "In addition to `worker` tasks, a `chief` task type is used; in this
            # case, this function should be modified to `return task_type == 'chief'`."
            return task_type == "chief"
    else:
        def _is_chief(task_type, task_id):
            return (task_type == "worker" and task_id == 0) or task_type is None

    def _get_temp_dir(dirpath, task_id):
        base_dirpath = "workertemp_" + str(task_id)
        temp_dir = os.path.join(dirpath, base_dirpath)
        os.makedirs(temp_dir, exist_ok=True)
        return temp_dir

    def write_filepath(filepath, task_type, task_id):
        dirpath = os.path.dirname(filepath)
        base = os.path.basename(filepath)
        if not _is_chief(task_type, task_id):
            dirpath = _get_temp_dir(dirpath, task_id)
        return os.path.join(dirpath, base)

    task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
    write_model_path = write_filepath(model_path, task_type, task_id)
    torch.save(multi_worker_model.state_dict(), write_model_path)  # multi_worker_model.save(...)
    if not _is_chief(task_type, task_id):
        shutil.rmtree(os.path.dirname(write_model_path))
    resolver = strategy.cluster_resolver
    return (task_type, task_id, resolver.master(), resolver.cluster_spec().as_dict(), resolver.num_accelerators())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("with_chief", [False, True], ids=["workers-only", "with-chief"])
def test_tutorial_save_on_chief_keeps_the_chiefs_model(with_chief, tmp_path):
    n = 3 if with_chief else 2
    results = [r.value for r in run_workers(tutorial_worker, n, args=(with_chief, str(tmp_path)))]
    tasks = [("chief", 0), ("worker", 0), ("worker", 1)] if with_chief else [("worker", 0), ("worker", 1)]
    assert [r[:2] for r in results] == tasks
    addresses = [r[2] for r in results]
    assert len(set(addresses)) == n  # tf's master(): each task's own address
    assert all(r[3] == results[0][3] and len(sum(r[3].values(), [])) == n for r in results)
    assert all(r[4] == local_gpus() for r in results)
    assert sorted(os.listdir(tmp_path)) == ["keras-model"]  # the chief's model, no temp dirs left
    saved = torch.load(tmp_path / "keras-model")
    reference = train(sg.get_strategy())  # one process, the same global batches
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-6)
