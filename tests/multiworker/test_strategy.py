"""MultiWorkerMirroredStrategy: parity with one process, sharded stratagem input, `stratagem run`."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from stratagem.cli.run import add_parser, torchrun_args
from stratagem.cluster.resolvers import TorchrunClusterResolver
from stratagem.data import Dataset
from stratagem.distribute.strategies.multi_worker import MultiWorkerMirroredStrategy
from stratagem.testing import assert_matches_single_device, run_script, run_workers

HERE = Path(__file__).parent


def _model():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _per_example(logits, y):
    return nn.functional.cross_entropy(logits, y, reduction="none")


def _xy(i):
    g = torch.Generator().manual_seed(int(i))
    return torch.randn(5, generator=g), torch.randint(0, 3, (), generator=g)


def parity_worker() -> list:
    strategy = MultiWorkerMirroredStrategy(TorchrunClusterResolver(), devices="cpu")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (8, 8, 3)]
    assert_matches_single_device(strategy, _model, _sgd, _per_example, batches)
    # a stratagem pipeline of global batches of 8: each worker reads only its shard (4 per step)
    ds = Dataset.range(32).shuffle(16, seed=2).map(_xy).batch(8)
    shard = [x.shape[0] for x, _ in strategy.experimental_distribute_dataset(ds)]
    global_batches = [(x, y) for x, y in ds]
    assert_matches_single_device(strategy, _model, _sgd, _per_example, global_batches, rtol=1e-4, atol=1e-5)
    return shard


@pytest.mark.timeout(120)
def test_parity_and_sharded_input_on_two_workers():
    results = run_workers(parity_worker, 2, timeout=100)
    assert [r.value for r in results] == [[4, 4, 4, 4]] * 2


def _parse(argv):
    import argparse

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["run", *argv])


def test_run_builds_torchrun_arguments():
    args, env = torchrun_args(_parse(["-n", "2", "train.py", "--lr", "0.1"]))
    assert "--nproc-per-node=2" in args and "--local-addr=127.0.0.1" in args
    assert any(a.startswith("--rdzv-endpoint=127.0.0.1:") for a in args)
    assert args[-3:] == ["train.py", "--lr", "0.1"] and env["GLOO_SOCKET_IFNAME"] == "lo"
    args, _ = torchrun_args(_parse(["-n", "1", "--nnodes", "2", "--node-rank", "1", "--bind", "127.0.0.1",
                                    "--rdzv-endpoint", "127.0.0.1:29400", "--max-restarts", "3", "t.py"]))
    assert {"--rdzv-backend=static", "--node-rank=1", "--master-addr=127.0.0.1",
            "--master-port=29400", "--max-restarts=3"} <= set(args)
    with pytest.raises(ValueError, match="needs --rdzv-endpoint"):
        torchrun_args(_parse(["--nnodes", "2", "t.py"]))
    with pytest.raises(ValueError, match="no network interface"):
        torchrun_args(_parse(["--bind", "203.0.113.9", "t.py"]))


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_stratagem_run_two_replicas(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = run_script(["-m", "stratagem.cli.run", "-n", "2", str(HERE / "mw_script.py")], timeout=100,
                   env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr[-3000:]
    left = [f.name for f in tmp.iterdir() if not f.name.startswith("torchinductor_")]  # torch's cache, kept by design
    assert not left, f"left behind in TMPDIR: {left}"  # torch's agent's folder too
    digests = re.findall(r"rank=(\d) world=2 worker=0 digest=([0-9a-f]{16})", r.stdout)
    assert sorted(d[0] for d in digests) == ["0", "1"] and digests[0][1] == digests[1][1], r.stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
