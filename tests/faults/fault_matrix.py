"""The one-process fault matrix: every case a mistake a user makes or a fault one process meets
(a checkpoint damaged or its disk full, a rendezvous nobody answers, the public API misused,
a cluster description that cannot work, a ``stratagem`` command given bad arguments, the
readers of untrusted bytes fuzzed), each with what it must give: an error of a named class whose
message names the cause, or ``ok`` (handled: the case checks the result), and a bound.

Outcomes: ``clear error`` and ``ok``, and the ones that must stay at zero: ``hang`` (no answer
within the bound: the process is killed), ``silent wrong``, ``data lost``, ``leak`` (a process
the case started outlived it), ``unclear error`` (another class, or a message that does not say
what it must). Every case runs in a forked process; three at a time. The cases: this file
(checkpoints, rendezvous), misuse_cases.py, config_cases.py, fuzz_cases.py (helpers:
matrix_kit.py). The matrix tier runs them (tests/faults/test_matrix.py) and writes their rows
into docs/MULTIWORKER.md's table with the multi-process ones. Run:
``python tests/faults/fault_matrix.py [--write-doc] [NAME-SUBSTRING ...]``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from matrix_kit import Outcome, Spec, expect_error
from torch import nn

GOOD = ("clear error", "ok")
BAD = ("hang", "silent wrong", "data lost", "leak", "unclear error")


@dataclass(frozen=True)
class Row:
    case: str
    outcome: str
    detail: str
    expect: str = ""
    bound: float = 0.0
    seconds: float = 0.0

    def __str__(self) -> str:
        return f"{self.case:<52} {self.outcome:<13} {self.seconds:5.2f}s/{self.bound:g}s {self.detail[:150]}"


# --- checkpoints ------------------------------------------------------------------------------------
def _model(out: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, out))


def _manager(d: Path, **extra: object):  # type: ignore[no-untyped-def]
    from stratagem.train.checkpoint import Checkpoint, CheckpointManager

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return CheckpointManager(Checkpoint(model=model, optimizer=opt, **extra), d), model


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith((".tmp-", ".old-")))


def case_disk_full(d: Path) -> str:
    m, _ = _manager(d)
    m.save(1)

    def full(name: str) -> None:
        if name == "shared.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device")

    m._on_file_written = full
    text = expect_error(lambda: m.save(2), "step 2", "No space left on device", str(d))
    if _leftovers(d):
        raise Outcome("leak", f"left {_leftovers(d)}")
    m._on_file_written = None
    m.save(3)
    if [Path(p).name for p in m.checkpoints] != ["ckpt-1", "ckpt-3"]:
        raise Outcome("data lost", f"checkpoints now {m.checkpoints}")
    return text


def case_unencodable(d: Path) -> str:
    class Odd:
        def state_dict(self) -> dict:
            return {"x": object()}

        def load_state_dict(self, s: dict) -> None:
            pass

    m, _ = _manager(d, odd=Odd())
    text = expect_error(lambda: m.save(1), "odd.x")
    if _leftovers(d):
        raise Outcome("leak", f"left {_leftovers(d)}")
    return text


def case_concurrent_writer(d: Path) -> str:
    first, _ = _manager(d)
    first.save(1)
    code = (
        "import sys, torch; from torch import nn; from stratagem.train.checkpoint import Checkpoint, CheckpointManager\n"
        f"m = CheckpointManager(Checkpoint(model=nn.Linear(2, 2)), {str(d)!r})\n"
        "try:\n    m.save(2)\nexcept Exception as e:\n    print(f'{type(e).__name__}: {e}'); sys.exit(3)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if r.returncode != 3:
        raise Outcome("data lost", f"the second job wrote into a held directory (exit {r.returncode})")
    if "CheckpointDirectoryLockedError" not in r.stdout or f"pid {os.getpid()}" not in r.stdout:
        raise Outcome("unclear error", r.stdout[:200])
    if [Path(p).name for p in first.checkpoints] != ["ckpt-1"]:
        raise Outcome("data lost", f"checkpoints now {first.checkpoints}")
    return r.stdout.strip()


def case_dead_writer(d: Path) -> str:
    r = subprocess.run(
        [sys.executable, "-c",
         "import os, signal, torch; from torch import nn; from stratagem.train.checkpoint import Checkpoint, CheckpointManager\n"
         f"m = CheckpointManager(Checkpoint(model=nn.Linear(2, 2)), {str(d)!r}); m.save(1)\n"
         "m._on_file_written = lambda n: os.kill(os.getpid(), signal.SIGKILL); m.save(2)\n"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if r.returncode != -9:
        raise Outcome("unclear error", f"the writer was not killed: {r.stderr[-200:]}")
    m, _ = _manager(d)
    from stratagem.train.checkpoint import Checkpoint, CheckpointManager

    m = CheckpointManager(Checkpoint(model=nn.Linear(2, 2)), d)
    if m.restore_or_initialize() is None or not m.latest or not m.latest.endswith("ckpt-1"):
        raise Outcome("data lost", f"latest is {m.latest}")
    m.save(3)
    if _leftovers(d):
        raise Outcome("leak", f"the dead writer's {_leftovers(d)} stayed")
    return "lock taken over, its temporary directory removed, ckpt-1 intact"


def _tamper(ckpt: Path, edit: Callable[[dict], None]) -> None:
    from stratagem.train.checkpoint.files import _canonical

    meta = json.loads((ckpt / "metadata.json").read_text())
    meta.pop("sha256")
    edit(meta)
    meta["sha256"] = hashlib.sha256(_canonical(meta)).hexdigest()
    (ckpt / "metadata.json").write_text(json.dumps(meta))


def _restore_case(d: Path, damage: Callable[[Path], None], *needles: str) -> str:
    m, _ = _manager(d)
    m.save(1)
    damage(d / "ckpt-1")
    start = time.monotonic()
    text = expect_error(lambda: m.restore(d / "ckpt-1"), *needles)
    if time.monotonic() - start > 1.0:
        raise Outcome("hang", f"refused only after {time.monotonic() - start:.1f}s")
    return text


def case_bitflip(d: Path) -> str:
    def flip(c: Path) -> None:
        raw = bytearray((c / "shared.safetensors").read_bytes())
        raw[-1] ^= 1
        (c / "shared.safetensors").write_bytes(bytes(raw))

    return _restore_case(d, flip, "shared.safetensors", "sha256")


def case_truncated(d: Path) -> str:
    def cut(c: Path) -> None:
        raw = (c / "shared.safetensors").read_bytes()
        (c / "shared.safetensors").write_bytes(raw[: len(raw) // 2])

    return _restore_case(d, cut, "shared.safetensors", "bytes")


def case_outside(d: Path) -> str:
    def out(c: Path) -> None:
        info = json.loads((c / "metadata.json").read_text())["files"]["shared.json"]
        _tamper(c, lambda m: m["files"].update({"../../etc/passwd": info}))

    return _restore_case(d, out, "not a plain name inside the checkpoint directory")


def case_fifo(d: Path) -> str:
    def fifo(c: Path) -> None:
        os.remove(c / "shared.json")
        os.mkfifo(c / "shared.json")

    return _restore_case(d, fifo, "shared.json", "FIFO")


def case_device(d: Path) -> str:
    def dev(c: Path) -> None:
        os.remove(c / "shared.safetensors")
        os.symlink("/dev/zero", c / "shared.safetensors")

    return _restore_case(d, dev, "shared.safetensors", "symbolic link")


def case_pickle(d: Path) -> str:
    import pickle

    class Boom:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {d / 'pwned'}",))

    def plant(c: Path) -> None:
        (c / "shared.safetensors").write_bytes(pickle.dumps(Boom()))

    text = _restore_case(d, plant, "shared.safetensors")
    if (d / "pwned").exists():
        raise Outcome("silent wrong", "the pickle ran")
    return text


def case_shape_mismatch(d: Path) -> str:
    from stratagem.train.checkpoint import Checkpoint, CheckpointManager

    m, _ = _manager(d)
    m.save(1)
    m.close()
    model = _model(out=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    text = expect_error(
        lambda: CheckpointManager(Checkpoint(model=model, optimizer=opt), d).restore(d / "ckpt-1"), "1.weight", "shape"
    )
    if any(not torch.equal(before[k], v) for k, v in model.state_dict().items()):
        raise Outcome("silent wrong", "the failed restore changed the model")
    return text


def case_portable_to_plain_module(d: Path) -> str:
    from stratagem.train.checkpoint import load_state_dict

    m, model = _manager(d)
    m.save(1)
    plain = _model()
    plain.load_state_dict(load_state_dict(d))
    if any(not torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values())):
        raise Outcome("silent wrong", "the loaded weights differ")
    return "load_state_dict(directory) into a plain nn.Module: equal weights"


# --- rendezvous, losses ----------------------------------------------------------------------------
def case_silent_listener(d: Path) -> str:
    from stratagem.cluster.resolvers import SimpleClusterResolver
    from stratagem.distribute.bootstrap import CommunicationOptions, connect_to_cluster

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(srv.accept()[0]) for _ in range(100)], daemon=True).start()
    resolver = SimpleClusterResolver(f"127.0.0.1:{port}", 2, 1)
    return expect_error(
        lambda: connect_to_cluster(resolver, CommunicationOptions(timeout_seconds=2)),
        f"127.0.0.1:{port}", "rank 1", "phase: store handshake",
    )  # fmt: skip


def case_refused(d: Path) -> str:
    from stratagem.cluster import find_free_port
    from stratagem.cluster.resolvers import SimpleClusterResolver
    from stratagem.distribute.bootstrap import CommunicationOptions, connect_to_cluster

    port = find_free_port()
    resolver = SimpleClusterResolver(f"127.0.0.1:{port}", 2, 1)
    return expect_error(
        lambda: connect_to_cluster(resolver, CommunicationOptions(timeout_seconds=2)), f"127.0.0.1:{port}", "rank 1"
    )


def case_summing_loss(d: Path) -> str:
    from stratagem.train.losses import per_example_loss

    return expect_error(
        lambda: per_example_loss(lambda o, t: ((o - t) ** 2).sum(), torch.randn(8, 1), torch.randn(8, 1)),
        "sum of the batch's losses", "reduction='mean'",
    )  # fmt: skip


# --- multi-process (each run_workers job has its own hard timeout) ---------------------------------
def _multiworker() -> None:
    here = Path(__file__).resolve().parents[1]
    for p in (str(here / "multiworker"), str(here)):
        if p not in sys.path:
            sys.path.insert(0, p)


def case_replica_killed(d: Path) -> str:
    _multiworker()
    from mw_workers import fail_worker

    from stratagem.testing import run_workers

    r0, _ = run_workers(fail_worker, 2, args=(1, "sigkill"), timeout=60, check=False)
    line = next((ln for ln in r0.stderr.splitlines() if "WorkerFailedError" in ln), "")
    if r0.returncode in (0, None) or "worker 1 failed" not in line:
        raise Outcome("unclear error", f"survivor exit {r0.returncode}: {r0.stderr[-200:]}")
    return line[line.index("WorkerFailedError"):]


def case_batch_shapes_differ(d: Path) -> str:
    _multiworker()
    from mw_workers import shapes_worker

    from stratagem.testing import run_workers

    rs = run_workers(shapes_worker, 2, args=(3,), timeout=60, check=False)
    lines = [next((ln for ln in r.stderr.splitlines() if "global batch 3 has different" in ln), "") for r in rs]
    if not all(lines):
        raise Outcome("unclear error", f"exits {[r.returncode for r in rs]}")
    return lines[0][lines[0].index("RuntimeError"):]


def case_exit_while_watching(d: Path) -> str:
    _multiworker()
    from mw_workers import exit_worker

    from stratagem.testing import run_workers

    rs = run_workers(exit_worker, 2, args=("raise",), timeout=60, check=False)
    if any("terminate called" in r.stderr for r in rs) or [r.returncode for r in rs] != [1, 1]:
        raise Outcome("unclear error", f"exits {[r.returncode for r in rs]} (an abort at exit?)")
    return "both ranks exit 1 with their own error; no abort at interpreter exit"


_ORIGINAL: list[Spec] = [
    Spec("checkpoint: disk full during save", case_disk_full, "OSError 'step 2', 'No space left on device'; no leftovers"),
    Spec("checkpoint: a value that cannot be encoded", case_unencodable, "TypeError 'odd.x'; no leftovers"),
    Spec("checkpoint: a second job on the same directory", case_concurrent_writer,
         "CheckpointDirectoryLockedError 'pid <holder>'", 60.0),
    Spec("checkpoint: writer killed mid-save, then resumed", case_dead_writer,
         "ok: lock taken over, ckpt-1 intact", 60.0),
    Spec("checkpoint: a bit flipped", case_bitflip, "CheckpointCorruptError 'shared.safetensors', 'sha256'"),
    Spec("checkpoint: a file truncated", case_truncated, "CheckpointCorruptError 'shared.safetensors', 'bytes'"),
    Spec("checkpoint: metadata points outside", case_outside,
         "CheckpointCorruptError 'not a plain name inside the checkpoint directory'"),
    Spec("checkpoint: a part replaced by a FIFO", case_fifo, "CheckpointCorruptError 'shared.json', 'FIFO'"),
    Spec("checkpoint: a part linked to /dev/zero", case_device, "CheckpointCorruptError 'shared.safetensors', 'symbolic link'"),
    Spec("checkpoint: a pickle planted as a part", case_pickle, "CheckpointCorruptError 'shared.safetensors'; the pickle never runs"),
    Spec("checkpoint: restore into another shape", case_shape_mismatch, "ValueError '1.weight', 'shape'; the model unchanged"),
    Spec("checkpoint: load into a plain nn.Module", case_portable_to_plain_module, "ok: equal weights"),
    Spec("rendezvous: listener that never answers", case_silent_listener,
         "ClusterConfigurationError '<address>', 'rank 1', 'phase: store handshake'", 30.0),
    Spec("rendezvous: nobody at the address", case_refused, "ClusterConfigurationError '<address>', 'rank 1'", 30.0),
    Spec("fit: a loss function that sums", case_summing_loss, "ValueError 'sum of the batch's losses', \"reduction='mean'\""),
]


def _all_specs() -> list[Spec]:
    from config_cases import SPECS as config_specs
    from fuzz_cases import SPECS as fuzz_specs
    from misuse_cases import SPECS as misuse_specs

    specs = [*_ORIGINAL, *misuse_specs, *config_specs, *fuzz_specs]
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    assert not dup, f"two cases of one name: {dup}"
    return specs


#: every one-process case, by name (each one forked, with its bound)
CASES: dict[str, Spec] = {s.name: s for s in _all_specs()}

#: multi-process cases the script runs too (each is a test of its own in tests/multiworker)
WORKER_CASES: dict[str, Spec] = {s.name: s for s in [
    Spec("workers: a replica killed mid-training", case_replica_killed, "WorkerFailedError 'worker 1 failed'", 90.0),
    Spec("workers: a later global batch of another shape", case_batch_shapes_differ,
         "RuntimeError 'global batch 3 has different'", 90.0),
    Spec("workers: exit while the watcher is in the store", case_exit_while_watching, "ok: both ranks exit 1", 90.0),
]}


def _child(spec: Spec, d: str, conn: object) -> None:
    import psutil

    try:
        detail = spec.fn(Path(d))
        outcome = "clear error" if detail.split(":")[0].endswith("Error") else "ok"
        if spec.expect_class is None and outcome != "ok":
            outcome, detail = "unclear error", f"expected {spec.expect}, got {detail}"
        elif spec.expect_class is not None and outcome != "clear error":
            outcome, detail = "silent wrong", f"expected {spec.expect_class}, got {detail}"
    except Outcome as o:
        outcome, detail = o.outcome, str(o)
    except BaseException as e:  # noqa: BLE001
        outcome, detail = "unclear error", f"{type(e).__name__}: {e} {traceback.format_exc()[-300:]}"
    # nothing the case started outlives it
    left = [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != "zombie"]
    if left:
        _, alive = psutil.wait_procs(left, timeout=2)
        if alive:
            outcome, detail = "leak", f"{len(alive)} process(es) outlived the case: {[p.pid for p in alive]}; {detail}"
            for p in alive:
                p.kill()
    conn.send((outcome, detail))  # type: ignore[attr-defined]


def run(names: list[str] | None = None, jobs: int = 3, cases: dict[str, Spec] | None = None) -> list[Row]:
    """Every case (or those named), each in a forked process that must answer within its
    bound (past it: a hang, and the process is killed); ``jobs`` of them at a time."""
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("fork")
    table = CASES if cases is None else cases
    # the cases that start processes of their own (the longest bounds) first: the short ones fill the gaps
    todo = sorted((s for n, s in table.items() if names is None or n in names), key=lambda s: -s.bound)
    done: dict[str, Row] = {}
    running: dict[object, tuple[Spec, object, tempfile.TemporaryDirectory[str], float]] = {}
    while todo or running:
        while todo and len(running) < jobs:
            spec = todo.pop(0)
            tmp = tempfile.TemporaryDirectory(prefix="sg-fm-")
            here, there = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(spec, tmp.name, there))
            p.start()
            there.close()
            running[here] = (spec, p, tmp, time.monotonic())
        now = time.monotonic()
        timeout = max(0.0, min(start + spec.bound for spec, _, _, start in running.values()) - now)
        ready = wait(list(running), timeout=timeout)
        now = time.monotonic()
        for conn in list(running):
            spec, p, tmp, start = running[conn]
            if conn in ready:
                try:
                    outcome, detail = conn.recv()  # type: ignore[attr-defined]
                except EOFError:
                    outcome, detail = "unclear error", "the case's process died without an answer"
            elif now >= start + spec.bound:
                outcome, detail = "hang", f"no answer within its bound of {spec.bound:g}s"
            else:
                continue
            seconds = now - start
            del running[conn]
            p.join(5)  # type: ignore[attr-defined]
            if p.is_alive():  # type: ignore[attr-defined]
                p.kill()  # type: ignore[attr-defined]
                p.join()  # type: ignore[attr-defined]
            tmp.cleanup()
            done[spec.name] = Row(spec.name, outcome, " ".join(detail.split()), spec.expect, spec.bound, seconds)
    return [done[n] for n in table if n in done]


def summary(rows: list[Row]) -> str:
    counts = {k: sum(r.outcome == k for r in rows) for k in (*GOOD, *BAD)}
    return f"{len(rows)} cases: " + ", ".join(f"{v} {k}" for k, v in counts.items())


def write_doc(rows: list[Row], seconds: float) -> None:
    """Rewrite the one-process rows of docs/MULTIWORKER.md's table (the multi-process rows of
    the last full run of the matrix tier stay as they are)."""
    import matrix_table

    mp_stamp, mp, _ = matrix_table.read()
    op = [matrix_table.one_process_cells(r) for r in rows]
    op_stamp = (f"{matrix_table.machine()}, `python tests/faults/fault_matrix.py --write-doc` "
                f"({len(op)} cases, every one forked, in {seconds:.0f} s)")
    matrix_table.write(matrix_table.render(mp_stamp, mp, op_stamp, op))


def main() -> None:
    """``python tests/faults/fault_matrix.py [--write-doc] [NAME-SUBSTRING ...]``: the cases (the
    multi-process "workers:" ones too, unless --write-doc), one line each."""
    args = sys.argv[1:]
    doc = "--write-doc" in args
    wanted = [a for a in args if a != "--write-doc"]
    table = CASES if doc else {**CASES, **WORKER_CASES}
    start = time.monotonic()
    rows = run([n for n in table if not wanted or any(w in n for w in wanted)], cases=table)
    seconds = time.monotonic() - start
    for row in rows:
        print(row)
    print(summary(rows), f"in {seconds:.0f} s")
    if doc:
        if wanted or any(r.outcome not in GOOD for r in rows):
            raise SystemExit("--write-doc writes the rows of a run of every case, all of them good")
        write_doc(rows, seconds)


if __name__ == "__main__":
    main()
