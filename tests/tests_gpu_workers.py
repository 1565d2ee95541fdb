"""Worker functions for tests/test_gpu.py (run in fresh processes)."""

from __future__ import annotations

import torch
from torch import nn

import stratagem as sg
from stratagem.testing import assert_matches_single_device


def nccl_parity_worker() -> str:
    strategy = sg.MirroredStrategy(devices="cuda", num_replicas=2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (8, 8, 3)]
    assert_matches_single_device(
        strategy,
        lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)),
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda logits, y: nn.functional.cross_entropy(logits.cpu(), y.cpu(), reduction="none"),
        batches,
        atol=1e-5,
    )
    return "ok"


def nccl_one_worker() -> str:
    """One process under torchrun's variables: an NCCL group of one through our Communicator,
    MirroredStrategy on the GPU, and a one-stage pipeline placed on the GPU."""
    import os

    import torch.distributed as dist

    from stratagem.comm import ProcessGroupCommunicator

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=0, world_size=1)
    comm = ProcessGroupCommunicator(dist.group.WORLD, torch.device("cuda", 0))
    assert comm.all_reduce(torch.ones(3, device="cuda"), "sum").tolist() == [1.0, 1.0, 1.0]
    strategy = sg.MirroredStrategy(devices="cuda", num_replicas=1)
    with strategy.scope():
        model = nn.Linear(4, 2)
    assert model.weight.device.type == "cuda"
    total = strategy.reduce("sum", strategy.run(lambda: torch.ones(2, device="cuda")))
    assert float(total.sum()) == 2.0
    pipe_strategy = sg.PipelineStrategy(1, 2, devices="cuda")
    with pipe_strategy.scope():
        seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pipe = pipe_strategy.pipeline(seq, nn.CrossEntropyLoss(), verbose=False)
    loss = pipe_strategy.run(pipe.train_step, args=(torch.randn(4, 4), torch.randint(0, 2, (4,))))
    assert torch.isfinite(torch.as_tensor(loss)).all()
    return "ok"
