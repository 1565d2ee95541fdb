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


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.down(x))


def resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's resnet18 architecture, written out so the benchmark needs no torchvision."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


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
    p.add_argument("--channels-last", action="store_true", help="model and inputs in channels_last (4-D inputs)")
    p.add_argument("--onedevice", action="store_true",
                   help="also time OneDeviceStrategy.run on the plain loop's step against that loop")
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
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    xs = torch.randn(*shape, device=dev).contiguous(memory_format=fmt) if len(shape) == 4 else torch.randn(*shape, device=dev)
    ys = torch.randint(0, 10, (args.batch,), device=dev)
    batches = [(xs, ys)] * args.steps
    spe = args.steps_per_execution if args.steps_per_execution == "auto" else int(args.steps_per_execution)

    strategy = sg.OneDeviceStrategy(dev)
    with strategy.scope():
        model = make().to(memory_format=fmt)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run_model = make().to(memory_format=fmt)  # the --onedevice arm: the plain step under strategy.run
        run_opt = torch.optim.SGD(run_model.parameters(), lr=0.01)
    plain_model = make().to(dev, memory_format=fmt)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    autocast = args.precision in ("bf16", "fp16")
    amp_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float16

    def plain_step(x: torch.Tensor, y: torch.Tensor, correct: torch.Tensor, loss_sum: torch.Tensor,
                   m: nn.Module = plain_model, o: torch.optim.Optimizer = plain_opt) -> None:
        o.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=amp_dtype, enabled=autocast):
            out = m(x)
            loss = loss_fn(out, y)
        loss.backward()
        o.step()
        correct += (out.argmax(1) == y).sum()  # what fit logs: accuracy and the mean loss
        loss_sum += loss.detach()

    def plain_round(run: bool = False) -> float:
        """The plain loop; with ``run``, each step goes through ``OneDeviceStrategy.run``."""
        correct = torch.zeros((), device=dev)
        loss_sum = torch.zeros((), device=dev)
        t0 = time.perf_counter()
        for x, y in batches:
            if run:
                strategy.run(plain_step, args=(x, y, correct, loss_sum, run_model, run_opt))
            else:
                plain_step(x, y, correct, loss_sum)
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
    if args.onedevice:
        plain_round(run=True)
    plain, ours, one = [], [], []
    for _ in range(args.rounds):
        plain.append(plain_round())
        ours.append(fit_round())
        if args.onedevice:
            one.append(plain_round(run=True))
    p_med, o_med = statistics.median(plain), statistics.median(ours)
    print(f"{args.model} on {dev}, batch {args.batch}, precision {args.precision}, "
          f"steps_per_execution={args.steps_per_execution}")
    print(f"plain torch loop  {p_med:8.1f} steps/s")
    print(f"stratagem.fit     {o_med:8.1f} steps/s")
    print(f"fit / plain       {o_med / p_med:8.3f}x  (target >= 0.95; >= 0.97 for ResNet-18 on a GPU)")
    print(f"RESULT fit_vs_plain={o_med / p_med:.4f}")  # for scripts/gpu_check.sh
    if args.onedevice:
        r_med = statistics.median(one)
        print(f"OneDevice.run     {r_med:8.1f} steps/s")
        print(f"OneDevice / plain {r_med / p_med:8.3f}x  (target >= 0.98)")
        print(f"RESULT onedevice_vs_plain={r_med / p_med:.4f}")


if __name__ == "__main__":
    main()
