"""A parameter-server job (run as `stratagem run --workers N --ps P ps_train.py MODE ...`): a
model with an embedding table and an MLP trained by functions the coordinator schedules.

parity OPT     one worker: equal to one process at 1e-5 (OPT: sgd, adagrad, or sgd_steplr: SGD
               with a StepLR on the chief, stepped after each function)
kill           two workers, worker 1 dies in its third function: every result delivered once
rejoin         as kill, and the launcher restarts worker 1: it rejoins and runs functions again
rejoin_idle    the same, but worker 1 dies and comes back while it has no function to run
rejoin_many OPT R
               as rejoin, R times in a row: each of worker 1's first R processes dies in its third
               function (scripts/ps_rejoin_stress.py; `--max-restarts R`)
all_lost       both workers die in their second function; the chief waits for them to be restarted
all_lost_fetch the same without restarts, each function fetched in turn: the fetch of the one
               under way when the last worker dies raises WorkerLostError (it does not wait forever)
converge       two workers on their own shards, asynchronous: the held-out loss falls as one
               process's does
ps_lost        ps 0 dies: the coordinator raises a clear error naming the last checkpoint
ps_stopped     ps 0 is stopped (SIGSTOP) after some steps; the chief's next forward pass, which
               reads the variables from the ps tasks, raises a clear error within seconds (not
               at the 120 s timeout of the read)
ps_restart OPT DIR
               one worker; ps 0 dies after a checkpoint at step 6; `stratagem run --max-restarts 1`
               starts the job again, which restores it and trains on: the end equals one process
checkpoint DIR one worker: a checkpoint of the ps-held model and optimizer restores in a plain
               process and training goes on there exactly as on the cluster
errors         misuse gets clear errors
fit            one worker: sg.fit (steps_per_epoch, metrics, validation) equals fit in one process
"""

import json
import os
import sys

import torch
from torch import nn

import stratagem as sg

BATCH, VOCAB, DIM = 16, 50, 8


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(3 * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).flatten(1)).squeeze(1)


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (steps * BATCH, 3), generator=g)
    truth = torch.randn(VOCAB, generator=g)
    y = truth[ids].sum(1)  # a task the model can learn
    return [(ids[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(steps)]


class Fussy(torch.optim.SGD):
    """An optimizer that refuses to step (its step runs on the ps task)."""

    def step(self, closure=None):
        raise ValueError("the fussy optimizer refuses")


def scheduler(opt, kind):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5) if kind == "sgd_steplr" else None


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind in ("sgd", "sgd_steplr"):
        return torch.optim.SGD(model.parameters(), lr=0.05)
    # an embedding updated row by row wants an optimizer that takes sparse gradients
    return torch.optim.Adagrad(model.parameters(), lr=0.1)


def reference_losses(model: nn.Module, kind: str, data: list) -> list[float]:
    opt = make_optimizer(model, kind)
    sched = scheduler(opt, kind)
    out = []
    for ids, y in data:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(ids), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        out.append(loss.item())
    return out


def main() -> None:
    mode = sys.argv[1]
    kind = sys.argv[2] if len(sys.argv) > 2 else "sgd"
    deaths = int(sys.argv[3]) if mode == "rejoin_many" else 1  # how many of worker 1's processes die
    steps = {"ps_restart": 24, "parity": 12, "kill": 24, "rejoin": 400, "rejoin_idle": 400, "rejoin_many": 400, "all_lost": 400, "all_lost_fetch": 40, "converge": 240, "ps_lost": 40, "ps_stopped": 6, "checkpoint": 12, "errors": 4, "fit": 12}[mode]
    partitioner = sg.partitioners.FixedShardsPartitioner(2)
    strategy = sg.ParameterServerStrategy(variable_partitioner=partitioner)
    # from here on only the chief runs this script
    torch.manual_seed(0)
    reference = Model()
    torch.manual_seed(0)
    with strategy.scope():
        model = Model()
        optimizer = make_optimizer(model, kind)
    coordinator = sg.coordinator.ClusterCoordinator(strategy)

    def dataset_fn(ctx):
        import itertools  # runs on the worker

        if mode == "converge":  # each worker reads its own shard (tf's InputContext), repeated:
            # which worker runs how many of the functions is not fixed
            return itertools.cycle(batches(steps + 20)[:steps][ctx.input_pipeline_id :: ctx.num_input_pipelines])
        if mode.startswith("rejoin") or mode == "all_lost":
            # rounds go on until the restarted worker has run some: the others must not run out
            return itertools.cycle(batches(steps))
        return batches(steps)

    per_worker = coordinator.create_per_worker_dataset(dataset_fn)
    iterator = iter(per_worker)

    def step_fn(it, index):
        def replica_fn(ids, y):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(ids), y)
            loss.backward()
            optimizer.step()
            return loss

        task = json.loads(os.environ["TF_CONFIG"])["task"]
        restart = int(os.environ.get("STRATAGEM_RESTART_COUNT", "0"))
        if mode in ("all_lost", "all_lost_fetch") and restart == 0:
            calls = int(os.environ.get("STEP_CALLS", "0")) + 1
            os.environ["STEP_CALLS"] = str(calls)
            if calls == 2:
                os._exit(7)  # each worker dies in its second function: none is left for a while
        if mode in ("kill", "rejoin", "rejoin_many") and task["index"] == 1 and restart < deaths:
            calls = int(os.environ.get("STEP_CALLS", "0")) + 1  # this worker's count
            os.environ["STEP_CALLS"] = str(calls)
            if calls == 3:
                os._exit(7)  # worker 1 dies in the middle of its third function
        ids, y = next(it)
        loss = strategy.run(replica_fn, args=(ids, y))
        if mode.startswith("rejoin") or mode == "all_lost":
            return index, strategy.reduce("SUM", loss, axis=None), f"{task['index']}.{restart}"
        return index, strategy.reduce("SUM", loss, axis=None)

    if mode == "fit":
        fit(strategy, model, optimizer, reference, kind, steps)
        return
    if mode == "errors":
        errors(strategy, coordinator, model, optimizer, step_fn, iterator)
        return
    if mode == "checkpoint":
        checkpoint(sys.argv[3], strategy, coordinator, model, optimizer, step_fn, iterator, steps)
        return
    if mode == "ps_restart":
        ps_restart(sys.argv[3], coordinator, model, optimizer, reference, kind, step_fn, steps)
        return
    if mode == "ps_lost":
        import torch.distributed.rpc as rpc

        manager = sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=optimizer), sys.argv[3])
        for i in range(steps):
            coordinator.schedule(step_fn, args=(iterator, i))
            if i == 5:
                coordinator.join()
                manager.save(6)
                rpc.rpc_async("ps:0", os._exit, args=(9,))  # ps 0 dies
        coordinator.join()
        raise AssertionError("training went on without ps 0")

    if mode == "ps_stopped":
        import signal
        import time

        import torch.distributed.rpc as rpc

        for i in range(steps):
            coordinator.schedule(step_fn, args=(iterator, i))
        coordinator.join()
        os.kill(rpc.rpc_sync("ps:0", os.getpid), signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            model(batches(1)[0][0])  # the chief's first forward after the functions: a read from the ps tasks
        except sg.ParameterServerError:
            print(f"RESULT raised_after={time.monotonic() - stopped:.2f}", flush=True)
            raise
        raise AssertionError("the read from a stopped ps task returned")

    if mode == "all_lost_fetch":
        import time

        start = time.monotonic()
        try:
            for i in range(steps):
                coordinator.schedule(step_fn, args=(iterator, i)).fetch()
        except sg.coordinator.WorkerLostError as e:
            print(f"RESULT raised_after={time.monotonic() - start:.1f} lost={sorted(coordinator.lost_workers)} {e}", flush=True)
            return
        raise AssertionError("training went on without its workers")
    if mode.startswith("rejoin") or mode == "all_lost":
        rejoin(coordinator, step_fn, iterator, idle=mode == "rejoin_idle", deaths=deaths)
        return
    sched = scheduler(optimizer, kind)
    if sched is not None:  # the learning rate changes on the chief between functions
        values = []
        for i in range(steps):
            values.append(coordinator.schedule(step_fn, args=(iterator, i)))
            values[-1].fetch()
            sched.step()
    else:
        values = [coordinator.schedule(step_fn, args=(iterator, i)) for i in range(steps)]
    coordinator.join()
    results = [v.fetch() for v in values]
    got = [float(loss) for _, loss in results]
    assert [i for i, _ in results] == list(range(steps)), results  # each delivered once, in place

    if mode == "parity":
        want = reference_losses(reference, kind, batches(steps))
        state = model.state_dict()  # the chief reads the variables from the ps tasks
        diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        loss_diff = max(abs(a - b) for a, b in zip(got, want))
        print(f"RESULT param_diff={diff:.3g} loss_diff={loss_diff:.3g}")
        assert diff < 1e-5 and loss_diff < 1e-5, (diff, loss_diff)
    elif mode == "kill":
        print(f"RESULT lost={coordinator.lost_workers} delivered={len(results)}")
        assert coordinator.lost_workers == ["worker:1"], coordinator.lost_workers
    elif mode == "converge":
        # the two workers read disjoint shards asynchronously; one process reads the same batches
        # in turn. Judged on held-out data by the final weights (the chief reads them from the ps)
        data = batches(steps + 20)
        held_out = data[steps:]
        torch.manual_seed(0)
        untrained = Model()
        reference_losses(reference, kind, data[:steps])
        trained = Model()
        trained.load_state_dict(model.state_dict())
        start, ref, got_eval = (evaluate(m, held_out) for m in (untrained, reference, trained))
        print(f"RESULT start={start:.3f} trained={got_eval:.3f} reference={ref:.3f}")
        assert got_eval < 0.5 * start, (start, got_eval)
        # asynchronous updates: a gradient may be a step stale, so near one process, not equal
        assert got_eval < 1.5 * ref + 0.05, (got_eval, ref)


def evaluate(model: nn.Module, data: list) -> float:
    with torch.no_grad():
        return sum(nn.functional.mse_loss(model(ids), y).item() for ids, y in data) / len(data)


def rejoin(coordinator, step_fn, iterator, idle, deaths=1):
    """Functions are scheduled in rounds until worker 1's last process (after ``deaths``
    restarts) has run some (bounded)."""
    import time

    import torch.distributed.rpc as rpc

    last = f"1.{deaths}"
    results, deadline = [], time.monotonic() + 90 * deaths
    while time.monotonic() < deadline:
        if idle and len(results) == 8:  # nothing is scheduled: worker 1 dies, is restarted, asks back
            rpc.rpc_async("worker:1", os._exit, args=(7,))
            time.sleep(8)
        values = [coordinator.schedule(step_fn, args=(iterator, len(results) + i)) for i in range(8)]
        coordinator.join()
        results += [v.fetch() for v in values]
        if sum(who == last for _, _, who in results) >= 4:
            break
    assert [i for i, _, _ in results] == list(range(len(results))), results  # each delivered once
    ran = sorted({who for _, _, who in results})
    print(f"RESULT lost={sorted(coordinator.lost_workers)} ran_on={ran} back={sum(w == last for _, _, w in results) >= 4}")


def ps_restart(folder, coordinator, model, optimizer, reference, kind, step_fn, steps):
    import torch.distributed.rpc as rpc

    manager = sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=optimizer), folder)
    path = manager.restore_or_initialize()  # as a user's script does: the restarted job goes on
    start = 0 if path is None else int(path.rsplit("-", 1)[1])
    data = batches(steps)[start:]  # the data position: the steps done (one worker reads in order)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: iter(data)))
    values = []
    for i in range(start, steps):
        values.append(coordinator.schedule(step_fn, args=(iterator, i)))
        if i == 5 and start == 0:
            coordinator.join()
            manager.save(6)
            rpc.rpc_async("ps:0", os._exit, args=(9,))  # ps 0 dies, its variables with it
    coordinator.join()
    got = [float(v.fetch()[1]) for v in values]
    want = reference_losses(reference, kind, batches(steps))[start:]
    state = model.state_dict()
    diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    loss_diff = max(abs(a - b) for a, b in zip(got, want))
    print(f"RESULT start={start} restart={os.environ['STRATAGEM_RESTART_COUNT']} param_diff={diff:.3g} "
          f"loss_diff={loss_diff:.3g}")
    assert diff < 1e-5 and loss_diff < 1e-5, (diff, loss_diff)


def checkpoint(folder, strategy, coordinator, model, optimizer, step_fn, iterator, steps):
    half = steps // 2
    for i in range(half):
        coordinator.schedule(step_fn, args=(iterator, i))
    coordinator.join()
    path = sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=optimizer), folder).save(half)
    later = [coordinator.schedule(step_fn, args=(iterator, i)) for i in range(half, steps)]
    got = [float(v.fetch()[1]) for v in later]
    # a plain process (no strategy) restores the checkpoint and trains the same batches
    plain = Model()
    plain_opt = make_optimizer(plain, "adagrad")
    sg.CheckpointManager(sg.Checkpoint(model=plain, optimizer=plain_opt), folder).restore(path)
    want = []
    for ids, y in batches(steps)[half:]:
        plain_opt.zero_grad()
        loss = nn.functional.mse_loss(plain(ids), y)
        loss.backward()
        plain_opt.step()
        want.append(loss.item())
    state = model.state_dict()
    diff = max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    loss_diff = max(abs(a - b) for a, b in zip(got, want))
    print(f"RESULT param_diff={diff:.3g} loss_diff={loss_diff:.3g}")
    assert diff < 1e-5 and loss_diff < 1e-5, (diff, loss_diff)
    # and back: the plain process's state restored onto the cluster is what the ps tasks hold
    path2 = sg.CheckpointManager(sg.Checkpoint(model=plain, optimizer=plain_opt), folder + "/plain").save(steps)
    sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=optimizer), folder + "/plain").restore(path2)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    sums = [s["sum"] for s in optimizer.state_dict()["state"].values()]
    assert all(torch.equal(a, b["sum"]) for a, b in zip(sums, plain_opt.state_dict()["state"].values()))


def fit(strategy, model, optimizer, reference, kind, steps):
    data = batches(steps)
    val = batches(3, seed=2)
    try:
        sg.fit(model, optimizer, "mse", data, epochs=2, verbose=0)
    except ValueError as e:
        print("ERROR", str(e).split(",")[0])
    kwargs = dict(epochs=2, steps_per_epoch=steps // 2, metrics=["mae"], validation_data=val, verbose=0)
    got = sg.fit(model, optimizer, "mse", data, **kwargs).history
    want = sg.fit(reference, make_optimizer(reference, kind), "mse", data, **kwargs).history
    assert got.keys() == want.keys(), (got, want)
    diff = max(abs(a - b) for k in got for a, b in zip(got[k], want[k]))
    state = model.state_dict()
    pdiff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    print(f"RESULT history_diff={diff:.3g} param_diff={pdiff:.3g} keys={sorted(got)}")
    assert diff < 1e-5 and pdiff < 1e-5, (got, want)


def errors(strategy, coordinator, model, optimizer, step_fn, iterator):
    try:
        optimizer.step()
    except RuntimeError as e:
        print("ERROR", str(e).split(";")[0])
    import threading

    lock = threading.Lock()
    v = coordinator.schedule(lambda x: x, args=(lock,))
    try:
        v.fetch()
    except TypeError as e:
        print("ERROR", str(e).split(":")[0])
    try:
        coordinator.join()
    except TypeError:
        pass
    bad = coordinator.schedule(lambda: 1 / 0)
    try:
        coordinator.join()
    except ZeroDivisionError as e:
        print("ERROR", type(e).__name__, str(e))
    assert bad.done()
    try:
        sg.coordinator.ClusterCoordinator(sg.OneDeviceStrategy())
    except TypeError as e:
        print("ERROR", e)
    # an exception raised on a ps task is the function's error, not a lost ps
    with strategy.scope():
        other = nn.Linear(2, 1)
        fussy = Fussy(other.parameters(), lr=0.1)

    def fussy_step():
        def replica_fn():
            fussy.zero_grad()
            other(torch.ones(1, 2)).sum().backward()
            fussy.step()

        strategy.run(replica_fn)

    coordinator.schedule(fussy_step)
    try:
        coordinator.join()
    except ValueError as e:
        print("ERROR", type(e).__name__, e)
    index, _ = coordinator.schedule(step_fn, args=(iterator, 0)).fetch()  # training goes on
    print("ERROR none after it:", index)


if __name__ == "__main__":
    main()
