"""ShardedStrategy (FSDP2 under the hood) trained on the job's processes, checked against one
process training on the same global batches; prints the largest difference. Run by
`stratagem run` on each host (tests/net/test_across_hosts.py)."""

from __future__ import annotations

import torch
from torch import nn

import stratagem
from stratagem.testing.contracts import train_reference, train_under


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


def make_sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def per_example(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


g = torch.Generator().manual_seed(1)
batches = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(6)]
strategy = stratagem.ShardedStrategy()
model, _ = train_under(strategy, make_model, make_sgd, per_example, batches)
got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in model.state_dict().items()}
want = train_reference(make_model, make_sgd, per_example, batches)
diff = max(float((got[k] - w).abs().max()) for k, w in want.items())
rank = strategy.extended.replica_id if hasattr(strategy.extended, "replica_id") else -1
print(f"sharded rank {rank} of {strategy.num_replicas_in_sync}: max difference from one process {diff:.3g}", flush=True)
