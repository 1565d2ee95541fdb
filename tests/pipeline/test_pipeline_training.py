"""PipelineStrategy on 2 and 4 gloo processes: parity with the unsplit model for every schedule x
re-materialization mode x micro-batch count, dropout replay, BatchNorm, the hybrid with data
parallelism, and failures that reach every process fast."""

from __future__ import annotations

import itertools
import re
import time

import pytest
import torch
from torch import nn

from stratagem.distribute.strategies.pipeline import PipelineStrategy
from stratagem.pipeline import PipelineConfigError, PipelineError, StageShapeError
from stratagem.testing import run_workers

RTOL, ATOL = 1e-5, 4e-5
SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved_1f1b")
#: interleaved_1f1b (2 chunks per stage) cuts the 6-layer dropout model so that the dropout
#: (layer 2) stays on stage 0, as [3, 3] puts it under the other schedules
DROPOUT_BALANCE = {"interleaved_1f1b": [3, 1, 1, 1]}


def build(dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(5, 16), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 3)]
    return nn.Sequential(*layers)


def build_bn() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                         nn.BatchNorm1d(8), nn.Linear(8, 3))  # fmt: skip


def batches(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def make_pipe(strategy, model_fn, loss_fn, seed=0, **kw):
    with strategy.scope():
        torch.manual_seed(seed)
        model = model_fn()
        pipe = strategy.pipeline(model, loss_fn, verbose=False, **kw)
        opt = sgd(pipe.parameters())
    return pipe, opt


def reference(model_fn, seed=0):
    torch.manual_seed(seed)
    model = model_fn()
    return model, sgd(model.parameters())


def compare(pipe, ref, what, errors, *, grads=True):
    refs = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        r = refs[name]
        a, b = (p.grad, r.grad) if grads else (p.detach(), r.detach())
        if a is None or b is None or not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
            diff = None if a is None or b is None else float((a - b).abs().max())
            errors.append(f"{what}: {'grad' if grads else 'value'} of {name} differs (max {diff})")


def check_step(pipe, ref, opts, loss, ref_loss, what, errors):
    """The step's loss and gradients equal the reference's; then both optimizers step."""
    if not torch.allclose(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL):
        errors.append(f"{what}: loss {float(loss)} != {float(ref_loss.detach())}")
    compare(pipe, ref, what, errors)
    for o in opts:
        o.step()
        o.zero_grad()


# --- launch 1: two stages, the whole matrix -----------------------------------------------------------
def matrix_worker() -> dict:
    errors: list[str] = []
    out: dict = {}
    data = batches([11, 11])
    for schedule in reversed(SCHEDULES):  # the last pipe (zero_bubble's, one chunk per stage) is looked at below
        for checkpoint in ("always", "except_last", "never"):
            for m in (1, 2, 8):
                for reduction in ("mean", "sum"):
                    what = f"{schedule}/{checkpoint}/M={m}/{reduction}"
                    s = PipelineStrategy(2, m, schedule=schedule, rematerialize=checkpoint, devices="cpu")
                    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
                    pipe, opt = make_pipe(s, build, loss_fn)
                    ref, ref_opt = reference(build)
                    compare(pipe, ref, what + " init", errors, grads=False)
                    for step, (x, y) in enumerate(data):
                        loss = s.run(pipe.train_step, args=(x, y))
                        ref_loss = loss_fn(ref(x), y)
                        ref_loss.backward()
                        check_step(pipe, ref, (opt, ref_opt), loss, ref_loss, f"{what} step {step}", errors)
                    compare(pipe, ref, what + " after 2 steps", errors, grads=False)
    out["names"] = [n for n, _ in pipe.named_parameters()]
    out["partition"] = str(s.partition)
    x = data[0][0]
    pred = pipe.predict(x)
    out["predict_ok"] = torch.allclose(pred, ref(x).detach(), rtol=RTOL, atol=ATOL)
    out["reduced"] = float(s.reduce("sum", s.run(pipe.train_step, args=data[0])))
    out["dropout"] = dropout_checks()
    out["bn"] = batchnorm_checks(errors)
    out["balance"] = balance_checks()
    out["errors"] = errors
    return out


def dropout_checks() -> dict:
    """Every mode and schedule gives the same dropout masks: recomputation replays the RNG."""
    x, y = batches([12])[0]
    results = {}
    for schedule in SCHEDULES:
        for checkpoint in ("always", "except_last", "never"):
            balance = DROPOUT_BALANCE.get(schedule, [3, 3])
            s = PipelineStrategy(2, 4, schedule=schedule, rematerialize=checkpoint, balance=balance, devices="cpu")
            pipe, _ = make_pipe(s, lambda: build(0.5), nn.CrossEntropyLoss())
            torch.manual_seed(7)
            loss = s.run(pipe.train_step, args=(x, y))
            grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
            results[(schedule, checkpoint)] = (float(loss), grads)
    base_loss, base = results[("gpipe", "never")]
    # bit-identical across re-materialization modes; across schedules only the order in which
    # micro-batch gradients are summed differs
    same = all(
        abs(loss - base_loss) < 1e-6 and all(torch.allclose(g[n], base[n], rtol=RTOL, atol=ATOL) for n in base)
        for loss, g in results.values()
    ) and all(
        results[(sch, ck)][0] == results[(sch, "never")][0]
        and all(torch.equal(results[(sch, ck)][1][n], results[(sch, "never")][1][n]) for n in base)
        for sch in SCHEDULES for ck in ("always", "except_last")
    )
    s = PipelineStrategy(2, 4, balance=[3, 3], devices="cpu")
    pipe, _ = make_pipe(s, lambda: build(0.5), nn.CrossEntropyLoss())
    pipe.eval()
    eval_loss = float(s.run(pipe.train_step, args=(x, y)))
    return {"same": same, "active": eval_loss != base_loss}


def batchnorm_checks(errors) -> bool:
    """BatchNorm uses per-micro-batch statistics (torchgpipe without deferred_batch_norm); its
    running statistics are updated once per micro-batch, also when it is recomputed."""
    x, y = batches([12])[0]
    loss_fn = nn.CrossEntropyLoss()
    for m, checkpoint, schedule in itertools.product((1, 3), ("always", "never"), ("gpipe", "zero_bubble", "interleaved_1f1b")):
        balance = [2, 1, 2, 1] if schedule == "interleaved_1f1b" else [3, 3]
        s = PipelineStrategy(2, m, schedule=schedule, rematerialize=checkpoint, balance=balance, devices="cpu")
        pipe, _ = make_pipe(s, build_bn, loss_fn)
        s.run(pipe.train_step, args=(x, y))
        ref, _ = reference(build_bn)
        for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
            (loss_fn(ref(xs), ys) * (len(xs) / len(x))).backward()
        what = f"batchnorm {schedule} M={m} {checkpoint}"
        compare(pipe, ref, what, errors)
        refs = dict(ref.named_buffers())
        for name, b in pipe.named_buffers():
            if not torch.allclose(b.float(), refs[name].float(), rtol=RTOL, atol=ATOL):
                errors.append(f"{what}: buffer {name} differs")
    return True


def balance_checks() -> dict:
    s = PipelineStrategy(2, 2, balance="time", devices="cpu")
    heavy = lambda: nn.Sequential(nn.Linear(5, 512), nn.Linear(512, 512), nn.Linear(512, 512),  # noqa: E731
                                  nn.Linear(512, 3))  # fmt: skip
    x = torch.randn(64, 5)
    make_pipe(s, heavy, nn.CrossEntropyLoss(), sample_input=x)
    timed = list(s.partition.balance)
    s = PipelineStrategy(2, 2, balance=[2, 2], devices="cpu")
    try:
        make_pipe(s, build, nn.CrossEntropyLoss())
        bad = "no error"
    except PipelineConfigError as e:
        bad = str(e)
    try:
        PipelineStrategy(3, 2, devices="cpu")
        world = "no error"
    except PipelineConfigError as e:
        world = str(e)
    try:
        s = PipelineStrategy(2, 2, devices="cpu")
        make_pipe(s, build, nn.functional.cross_entropy)
        reduction = "no error"
    except ValueError as e:
        reduction = str(e)
    return {"time": timed, "bad": bad, "world": world, "reduction": reduction}


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_two_stage_matrix():
    results = run_workers(matrix_worker, 2, timeout=200)
    r0, r1 = results[0].value, results[1].value
    assert r0["errors"] == [] and r1["errors"] == []
    assert r0["names"] == ["0.weight", "0.bias"]
    assert r1["names"] == ["2.0.weight", "2.0.bias", "3.weight", "3.bias"]
    assert "balance=[1, 4]" in r0["partition"]  # ties go to the earliest cut
    assert r0["predict_ok"] and r1["predict_ok"]
    assert r0["reduced"] == r1["reduced"]
    for r in (r0, r1):
        assert r["dropout"] == {"same": True, "active": True}
        assert r["balance"]["time"] == r0["balance"]["time"]
        assert r["balance"]["time"] in ([2, 2], [3, 1], [1, 3])
        assert "covers 4 layers but the model has 5" in r["balance"]["bad"]
        assert "has 2 processes but PipelineStrategy(num_stages=3" in r["balance"]["world"]
        assert "loss_reduction='mean' or 'sum'" in r["balance"]["reduction"]


# --- launch 2: a shape the next stage does not accept ----------------------------------------------
def shape_worker() -> tuple[str, str, float]:
    s = PipelineStrategy(2, 2, balance=[1, 1], devices="cpu")
    pipe, _ = make_pipe(s, lambda: nn.Sequential(nn.Linear(5, 7), nn.Linear(8, 3)), nn.CrossEntropyLoss())
    x, y = batches([8])[0]
    t0 = time.monotonic()
    try:
        s.run(pipe.train_step, args=(x, y))
    except PipelineError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "none", "", 0.0


@pytest.mark.timeout(60)
def test_shape_mismatch_names_both_stages():
    results = run_workers(shape_worker, 2, timeout=50)
    for r in results:
        kind, msg, secs = r.value
        assert kind in ("StageShapeError", "PipelineError"), msg
        assert "stage 1 cannot take the activation stage 0 sent" in msg
        assert "[4, 7]" in msg and "Linear(in_features=8" in msg and "Linear(in_features=5" in msg
        assert secs < 30  # promise: a shape error reaches both stages as an error, not a wait for the 120 s timeout
    assert results[1].value[0] == StageShapeError.__name__


# --- launch 3: an exception in one stage reaches every process ----------------------------------------
class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in backward")


class Boom(nn.Module):
    """Identity until armed; then raises in forward or in backward."""

    mode = ""

    def forward(self, x):
        if self.mode == "forward":
            raise ValueError("boom in forward")
        return _RaiseInBackward.apply(x) if self.mode == "backward" else x


def failure_worker(schedule: str, mode: str, position: int) -> tuple[str, float]:
    balance = [1, 1, 1, 1] if schedule == "interleaved_1f1b" else [2, 2]
    s = PipelineStrategy(2, 4, schedule=schedule, balance=balance, devices="cpu")
    boom = Boom()
    layers = [nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)]
    layers.insert(position, boom)  # position 1: stage 0, position 2: stage 1
    pipe, _ = make_pipe(s, lambda: nn.Sequential(*layers), nn.CrossEntropyLoss())
    x, y = batches([8])[0]
    s.run(pipe.train_step, args=(x, y))  # a good step first
    boom.mode = mode
    t0 = time.monotonic()
    try:
        s.run(pipe.train_step, args=(x, y))
    except PipelineError as e:
        return str(e), time.monotonic() - t0
    return "no error", 0.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "schedule,mode,position",
    [("1f1b", "forward", 2), ("gpipe", "forward", 1), ("gpipe", "backward", 2), ("1f1b", "backward", 1),
     ("zero_bubble", "backward", 1), ("zero_bubble", "backward", 2),
     ("interleaved_1f1b", "forward", 2), ("interleaved_1f1b", "backward", 1)],
)
def test_exception_in_one_stage_reaches_every_process(schedule, mode, position):
    results = run_workers(failure_worker, 2, args=(schedule, mode, position), timeout=50)
    # one layer per chunk under interleaved_1f1b: the Boom at ``position`` is chunk ``position``
    # (chunk 1 on stage 1, chunk 2 on stage 0); errors name the chunk
    stage = position if schedule == "interleaved_1f1b" else position - 1
    for r in results:
        msg, secs = r.value
        assert f"boom in {mode}" in msg and f"stage {stage}" in msg, msg
        assert secs < 30  # promise: a stage's exception reaches every stage, not after the 120 s timeout


# --- launch 4: two stages x two data-parallel copies ----------------------------------------------------
def hybrid_worker() -> list[str]:
    errors: list[str] = []
    for schedule, reduction in (("gpipe", "mean"), ("1f1b", "sum"), ("zero_bubble", "mean"), ("interleaved_1f1b", "sum")):
        s = PipelineStrategy(2, 2, schedule=schedule, data_parallel=2, devices="cpu")
        assert s.num_replicas_in_sync == 2
        loss_fn = nn.CrossEntropyLoss(reduction=reduction)
        pipe, opt = make_pipe(s, build, loss_fn)
        ref, ref_opt = reference(build)
        global_batches = batches([12, 11])  # the second splits 6/5 across the copies
        for step, (x, y) in enumerate(s.experimental_distribute_dataset(global_batches)):
            loss = s.run(pipe.train_step, args=(x, y))
            total = s.reduce("sum", loss)
            gx, gy = global_batches[step]
            ref_loss = loss_fn(ref(gx), gy)
            ref_loss.backward()
            check_step(pipe, ref, (opt, ref_opt), total, ref_loss, f"hybrid {schedule}/{reduction} step {step}", errors)
        compare(pipe, ref, f"hybrid {schedule} after 2 steps", errors, grads=False)
        # each copy's timeline holds both of its stages, the plan's actions once
        with s.profile(None) as timeline:
            s.run(pipe.train_step, args=next(iter(s.experimental_distribute_dataset(global_batches))))
        got = [[e.label for e in st] for st in timeline.stages]  # "2F0" under interleaved_1f1b
        if got != [[str(a) for a in acts] for acts in s.schedule.stages]:
            errors.append(f"hybrid {schedule}: timeline {got}")
    # gradual unfreezing: every layer frozen when the pipeline is built, all trainable from step 1
    s = PipelineStrategy(2, 2, data_parallel=2, devices="cpu")
    loss_fn = nn.CrossEntropyLoss()
    frozen = lambda: build().requires_grad_(False)  # noqa: E731
    pipe, opt = make_pipe(s, frozen, loss_fn)
    ref, ref_opt = reference(frozen)
    global_batches = batches([12, 12, 12], seed=4)
    for step, (x, y) in enumerate(s.experimental_distribute_dataset(global_batches)):
        ref.requires_grad_(step > 0)
        for _, p in pipe.named_parameters():
            p.requires_grad_(step > 0)
        if step > 0:
            s.run(pipe.train_step, args=(x, y))
            loss_fn(ref(global_batches[step][0]), global_batches[step][1]).backward()
            compare(pipe, ref, f"unfrozen step {step}", errors)
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
    compare(pipe, ref, "unfrozen after 2 steps", errors, grads=False)
    return errors


@pytest.mark.slow  # pipeline x data, as with nanoGPT's tie in real_models, in the slow tier (CI runs it): the main tier under 15 minutes
@pytest.mark.timeout(180)
def test_hybrid_two_stages_two_copies():
    results = run_workers(hybrid_worker, 4, timeout=150)
    assert [r.value for r in results] == [[]] * 4


# --- launch 5: a plain `python script.py` starts its own second stage ----------------------------------
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_plain_script_launches_its_stages():
    import re
    from pathlib import Path

    from stratagem.testing import run_script

    result = run_script([str(Path(__file__).with_name("pipeline_script.py"))], timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "partition by params: balance=" in result.stdout
    found = re.findall(r"stage (\d): loss ([\d.]+) -> ([\d.]+), accuracy ([\d.]+)", result.stdout)
    assert sorted(s for s, *_ in found) == ["0", "1"], result.stdout
    for _, first, last, acc in found:
        assert float(last) < float(first) / 2 and float(acc) >= 0.9
    assert found[0][1:] == found[1][1:]  # every stage reports the same loss and predictions


# --- launch 6: three stages, a middle stage that receives and sends in every I ------------------
def three_stage_worker() -> list[str]:
    errors: list[str] = []
    data = batches([13, 10])  # uneven micro-batches: 13 = 3+3+3+2+2
    for schedule, remat in (("zero_bubble", "except_last"), ("zero_bubble", "never"), ("1f1b", "always"),
                            ("interleaved_1f1b", "except_last")):  # fmt: skip
        model_fn = lambda: build(0.3)  # noqa: E731
        balance = [2, 2, 2]
        if schedule == "interleaved_1f1b":  # 3 x 2 chunks, each stage with a Linear
            model_fn = lambda: nn.Sequential(*build(0.3), nn.Linear(3, 3))  # noqa: E731
            balance = [2, 1, 1, 1, 1, 1]
        s = PipelineStrategy(3, 5, schedule=schedule, rematerialize=remat, balance=balance, devices="cpu")
        loss_fn = nn.CrossEntropyLoss()
        pipe, opt = make_pipe(s, model_fn, loss_fn)
        ref, ref_opt = reference(model_fn)
        for step, (x, y) in enumerate(data):
            torch.manual_seed(10 + step)
            loss = s.run(pipe.train_step, args=(x, y))
            torch.manual_seed(10 + step)
            # dropout (on stage 1) draws from that process's RNG micro-batch by micro-batch: the
            # reference replays the same draws by running the micro-batches in order
            ref_loss = sum(loss_fn(ref(xs), ys) * (len(xs) / len(x)) for xs, ys in zip(x.tensor_split(5), y.tensor_split(5)))
            ref_loss.backward()
            check_step(pipe, ref, (opt, ref_opt), loss, ref_loss, f"3 stages {schedule}/{remat} step {step}", errors)
        pipe.eval()
        ref.eval()
        x = data[0][0]
        if not torch.allclose(pipe.predict(x), ref(x).detach(), rtol=RTOL, atol=ATOL):  # round the ring
            errors.append(f"3 stages {schedule}: predict differs")
    return errors


@pytest.mark.timeout(150)
def test_three_stages_zero_bubble():
    results = run_workers(three_stage_worker, 3, timeout=120)
    assert [r.value for r in results] == [[]] * 3


def ring_failure_worker(mode: str = "backward", position: int = 1) -> tuple[str, float]:
    """3 stages x 2 chunks: the last chunk's rank sends to rank 0 (a ring); chunk ``position``
    (on rank ``position % 3``) fails in its ``mode`` pass."""
    s = PipelineStrategy(3, 6, schedule="interleaved_1f1b", balance=[1] * 6, devices="cpu")
    boom = Boom()
    layers: list[nn.Module] = [nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)]
    layers.insert(position, boom)
    pipe, _ = make_pipe(s, lambda: nn.Sequential(*layers), nn.CrossEntropyLoss())
    x, y = batches([12])[0]
    s.run(pipe.train_step, args=(x, y))
    boom.mode = mode
    t0 = time.monotonic()
    try:
        s.run(pipe.train_step, args=(x, y))
    except PipelineError as e:
        return str(e), time.monotonic() - t0
    return "no error", 0.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,position", [("backward", 1), ("forward", 3), ("forward", 5), ("backward", 2)])
def test_interleaved_failure_goes_round_the_ring(mode, position):
    """Every process learns of the failure, with its message, at once: also one that learns it
    from a third process while the failing one's marker to it is under way."""
    for r in run_workers(ring_failure_worker, 3, args=(mode, position), timeout=50):
        msg, secs = r.value
        # the promise: every stage learns of the failure within 5 s (docs/PIPELINE.md, failures)
        assert re.match(rf"stage {position}[ ,]", msg) and f"ValueError: boom in {mode}" in msg and secs < 5, (msg, secs)
        assert "cannot take the activation" not in msg, msg  # the layer failed, not the stage boundary


# --- launch 7: interleaved 1F1B: a stage holding several chunks (its checkpoint: tests/checkpoint) ---
def interleaved_worker(directory: str) -> dict:
    out: dict = {}
    s = PipelineStrategy(2, 4, schedule="interleaved_1f1b", devices="cpu")
    with s.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 3))
        pipe = s.pipeline(model, nn.CrossEntropyLoss(), verbose=False)
    # interleaved zero-bubble and 3 chunks per stage: BatchNorm, uneven micro-batches (11 = 3+3+3+2)
    loss_fn = nn.CrossEntropyLoss()
    out["errors"] = errors = []
    for schedule, v, remat in (("zero_bubble", 2, "except_last"), ("interleaved_1f1b", 3, "always")):
        s2 = PipelineStrategy(2, 4, schedule=schedule, virtual_stages=v, rematerialize=remat,
                              balance=[3, 3, 3, 3] if v == 2 else [2] * 6, devices="cpu")  # fmt: skip
        bn = lambda: nn.Sequential(  # noqa: E731
            nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8),
            nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3),
        )  # fmt: skip
        p2, o2 = make_pipe(s2, bn, loss_fn)
        ref, ref_opt = reference(bn)
        for step, (x, y) in enumerate(batches([11, 11], seed=3)):
            loss = s2.run(p2.train_step, args=(x, y))
            ref_loss = sum(loss_fn(ref(xs), ys) * (len(xs) / len(x)) for xs, ys in zip(x.tensor_split(4), y.tensor_split(4)))
            ref_loss.backward()
            check_step(p2, ref, (o2, ref_opt), loss, ref_loss, f"{schedule} v={v} step {step}", errors)
        refs = dict(ref.named_buffers())
        for name, b in p2.named_buffers():
            if not torch.allclose(b.float(), refs[name].float(), rtol=RTOL, atol=ATOL):
                errors.append(f"{schedule} v={v}: buffer {name} differs")
    out["names"] = sorted(pipe.state_dict())
    out["repr"] = repr(pipe)
    out["partition"] = str(s.partition)
    # balance="time" over the 4 chunks
    s = PipelineStrategy(2, 2, schedule="interleaved_1f1b", balance="time", devices="cpu")
    heavy = lambda: nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])  # noqa: E731
    make_pipe(s, heavy, nn.MSELoss(), sample_input=torch.randn(8, 64))
    out["time"] = list(s.partition.balance)
    try:
        make_pipe(PipelineStrategy(2, 2, schedule="interleaved_1f1b", virtual_stages=3, devices="cpu"), build,
                  nn.CrossEntropyLoss())  # fmt: skip
        out["few"] = "no error"
    except PipelineConfigError as e:
        out["few"] = str(e)
    return out


@pytest.mark.timeout(120)
def test_interleaved_stage_holds_its_chunks(tmp_path):
    r0, r1 = (r.value for r in run_workers(interleaved_worker, 2, args=(str(tmp_path),), timeout=100))
    # chunks 0 and 2 (Linear, Dropout) on stage 0, chunks 1 and 3 (Tanh, Linear) on stage 1
    assert (r0["names"], r1["names"]) == (["0.bias", "0.weight"], ["3.bias", "3.weight"])
    assert r0["errors"] == [] and r1["errors"] == []
    assert "Pipe(stage 1 of 2, layers 1..1, 3..3, interleaved_1f1b, 4 micro-batches" in r1["repr"]
    assert "chunk 3 (stage 1): layers 3..3" in r0["partition"]
    assert r0["time"] == r1["time"] and len(r0["time"]) == 4 and sum(r0["time"]) == 6
    assert "the model has 5 layers" in r0["few"] and "2 stages x 3 virtual stages = 6 chunks" in r0["few"]


class Keep(nn.Module):
    """Keeps every input it is given (the activation a stage received) and a copy of it."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept.append((x.detach(), x.detach().clone()))
        return x


def kept_inputs_worker(schedule: str) -> tuple[int, float]:
    """The stages reuse their message buffers from step to step: a module that keeps what it
    received must still hold it, unchanged, after later steps."""
    balance = [2, 1, 1, 2] if schedule == "interleaved_1f1b" else [2, 4]
    s = PipelineStrategy(2, 4, schedule=schedule, balance=balance, devices="cpu")
    pipe, opt = make_pipe(s, lambda: nn.Sequential(nn.Linear(5, 16), nn.Tanh(), Keep(), nn.Linear(16, 16), Keep(),
                                                   nn.Linear(16, 3)), nn.CrossEntropyLoss())  # fmt: skip
    for x, y in batches([8, 8, 8], seed=3):
        s.run(pipe.train_step, args=(x, y))
        opt.step()
        opt.zero_grad()
    kept = [pair for m in pipe.module.modules() if isinstance(m, Keep) for pair in m.kept]
    return len(kept), max((float((a - b).abs().max()) for a, b in kept), default=0.0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
def test_a_kept_activation_is_not_overwritten_by_later_steps(schedule):
    results = [r.value for r in run_workers(kept_inputs_worker, 2, args=(schedule,), timeout=80)]
    assert results[0][0] == 0 and results[1][0] >= 2 * 3 * 4, results  # stage 1: 2 Keeps x 3 steps x 4 micro-batches, more with re-materialization
    assert all(diff == 0.0 for _, diff in results), results


class Interrupted(nn.Module):
    """Identity until armed; then a Ctrl-C lands in its forward (as the SIGINT handler raises it)."""

    armed = False

    def forward(self, x):
        if self.armed:
            raise KeyboardInterrupt
        return x


def interrupt_worker() -> tuple[str, str]:
    s = PipelineStrategy(2, 4, balance=[2, 2], devices="cpu")
    stop = Interrupted()
    pipe, _ = make_pipe(s, lambda: nn.Sequential(nn.Linear(5, 8), stop, nn.Linear(8, 8), nn.Linear(8, 3)), nn.CrossEntropyLoss())
    x, y = batches([8])[0]
    s.run(pipe.train_step, args=(x, y))
    stop.armed = True
    try:
        s.run(pipe.train_step, args=(x, y))
    except KeyboardInterrupt:
        return "KeyboardInterrupt", ""
    except PipelineError as e:
        return "PipelineError", str(e)
    return "no error", ""


@pytest.mark.timeout(60)
def test_a_ctrl_c_in_a_stage_stays_a_keyboard_interrupt_there():
    """A program's `except KeyboardInterrupt:` (save on Ctrl-C) sees the Ctrl-C on the stage it
    landed in; the other stage learns that stage 0 was interrupted (a PipelineError naming it)."""
    got = [r.value for r in run_workers(interrupt_worker, 2, timeout=50)]
    assert got[0] == ("KeyboardInterrupt", ""), got
    assert got[1][0] == "PipelineError" and "stage 0" in got[1][1] and "KeyboardInterrupt" in got[1][1], got
