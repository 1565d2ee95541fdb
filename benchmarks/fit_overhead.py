"""fit against a plain torch loop on a tiny model (per-step overhead), measured in one run.

The same MLP, optimizer, data (batches already in memory) and metric on one device: a plain loop
(zero_grad, forward, loss, backward, step, and the accuracy count and loss sum kept as tensors,
what fit logs) against
``stratagem.fit`` with one metric under the default strategy. Rounds alternate so machine noise
hits both alike; steps/s is the median over rounds; the ratio is fit / plain (target >= 0.95).
Run: ``python benchmarks/fit_overhead.py [--device cuda] [--model resnet18]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import stratagem as sg


def tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def small() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def resnet18() -> nn.Module:
    import torchvision  # only for --model resnet18 (GPU figures)

    return torchvision.models.resnet18(num_classes=10)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny", choices=["tiny", "small", "resnet18"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200, help="steps per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps-per-execution", default="auto")
    p.add_argument("--precision", default="32")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable on a busy CPU)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    if args.model == "tiny":
        make, shape = tiny, (args.batch, 32)
    elif args.model == "small":
        make, shape = small, (args.batch, 256)
    else:
        make, shape = resnet18, (args.batch, 3, 112, 112)
    xs = torch.randn(*shape, device=dev)
    ys = torch.randint(0, 10, (args.batch,), device=dev)
    batches = [(xs, ys)] * args.steps
    spe = args.steps_per_execution if args.steps_per_execution == "auto" else int(args.steps_per_execution)

    strategy = sg.OneDeviceStrategy(dev)
    with strategy.scope():
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    plain_model = make().to(dev)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    autocast = args.precision in ("bf16", "fp16")
    amp_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float16

    def plain_round() -> float:
        correct = torch.zeros((), device=dev)
        loss_sum = torch.zeros((), device=dev)
        t0 = time.perf_counter()
        for x, y in batches:
            plain_opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=amp_dtype, enabled=autocast):
                out = plain_model(x)
                loss = loss_fn(out, y)
            loss.backward()
            plain_opt.step()
            correct += (out.argmax(1) == y).sum()  # what fit logs: accuracy and the mean loss
            loss_sum += loss.detach()
        float(correct), float(loss_sum)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return args.steps / (time.perf_counter() - t0)

    def fit_round() -> float:
        t0 = time.perf_counter()
        sg.fit(model, opt, loss_fn, batches, metrics=["sparse_categorical_accuracy"], verbose=0,
               steps_per_execution=spe, precision=args.precision)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return args.steps / (time.perf_counter() - t0)

    plain_round(), fit_round()  # warm up
    plain, ours = [], []
    for _ in range(args.rounds):
        plain.append(plain_round())
        ours.append(fit_round())
    p_med, o_med = statistics.median(plain), statistics.median(ours)
    print(f"{args.model} on {dev}, batch {args.batch}, precision {args.precision}, "
          f"steps_per_execution={args.steps_per_execution}")
    print(f"plain torch loop  {p_med:8.1f} steps/s")
    print(f"stratagem.fit     {o_med:8.1f} steps/s")
    print(f"fit / plain       {o_med / p_med:8.3f}x  (target >= 0.95)")


if __name__ == "__main__":
    main()
