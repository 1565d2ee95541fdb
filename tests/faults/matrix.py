"""The fault matrix over one host and many (issue 31): each case starts a job as a user would
(tests/faults/matrix_job.py), breaks one of its processes or hosts, and records the bound, the
time every process took to end (or the chief to notice, under ParameterServerStrategy, where it
carries on), and the line each rank printed about it. ``table(rows)`` is the table that
docs/MULTIWORKER.md shows (tests/faults/test_matrix.py writes it there after a full run).

Outcomes: ``ok``, and the ones that must stay at zero: ``over bound`` (a rank ended, or the chief
noticed, after the bound), ``hang`` (still running 20 s after it), ``wrong diagnosis`` (a rank
that says nothing about the fault, names the wrong peer or says what did not happen: "process
gone" for a peer on another host), ``leftover`` (a process of the job outlived it).

    python tests/faults/matrix.py [NAME-SUBSTRING ...]     (prints the table)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "src"))

from stratagem.cluster.launch import find_free_port  # noqa: E402
from stratagem.cluster.ps_launch import local_ps_cluster  # noqa: E402
from stratagem.testing import hosts as hosts_mod  # noqa: E402
from stratagem.testing.hosts import Hosts, job_env  # noqa: E402
from stratagem.testing.interrupts import JobProcesses  # noqa: E402

JOB = HERE / "matrix_job.py"
ONE_HOST_BOUND = 2.0  # docs/MULTIWORKER.md: on one host every rank ends within 2 s of a failure
HOSTS_BOUND = 10.0  # and across hosts within 10 s (a silent peer is waited for 6 s)
LAUNCHER_BOUND = 5.0  # `stratagem run` itself, after its ranks (one host)
SLACK = float(os.environ.get("MATRIX_SLACK", "20"))  # past the bound and still running: a hang
NEVER_TIMEOUT = 5  # CommunicationOptions.timeout_seconds of a job one of whose processes never comes
SLOW_FOR = 20.0  # seconds a link is held at 20 Mbit/s, where one all-reduce takes about 7 s
SIZES = {"mirrored": 2, "multiworker": 2, "sharded": 2, "pipeline": 3, "ps": 4}
PS_TASKS = ["chief", "worker 0", "worker 1", "ps 0"]
RANK = re.compile(r"^RANK (.+) PID (\d+)$")


@dataclass(frozen=True)
class Case:
    kind: str  # mirrored | multiworker | sharded | pipeline | ps
    fault: str  # raise | raise-in-step | kill | stop | cut | vanish | save-cut | slow | never
    target: str  # the process (its host, for a network fault) the fault hits: "worker 1", "stage 0", "ps 0", "chief"
    hosts: bool = False  # each process on a host of its own (network namespaces) or all on this one

    @property
    def name(self) -> str:
        return f"{self.kind} {'hosts' if self.hosts else 'one host'}: {self.fault} {self.target}"

    @property
    def bound(self) -> float:
        if self.fault == "never":  # from the imports' end (READY): the timeout runs out, then each ends
            return NEVER_TIMEOUT + 10.0
        return HOSTS_BOUND if self.hosts else ONE_HOST_BOUND

    @property
    def carries_on(self) -> bool:
        """Under ParameterServerStrategy a lost worker is not fatal: the chief goes on without it."""
        return self.kind == "ps" and self.target.startswith("worker") and self.fault != "raise-in-step"


@dataclass
class Row:
    case: Case
    outcome: str
    times: dict[str, float | None] = field(default_factory=dict)  # process -> seconds after the fault
    says: dict[str, str] = field(default_factory=dict)  # rank -> its line about the fault
    detail: str = ""

    def __str__(self) -> str:
        times = ", ".join(f"{k} {_secs(v)}" for k, v in self.times.items())
        return f"{self.case.name:<44} {self.outcome:<15} bound {self.case.bound:g}s | {times} | {self.detail[:200]}"


def _secs(v: float | None) -> str:
    return "never" if v is None else f"{v:.2f}s"


class _Output:
    """Every line a started process (and its children) printed, with the time it arrived."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = proc
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _env(**extra: str) -> dict[str, str]:
    # PYTHONFAULTHANDLER: a process still running past its bound is sent SIGABRT, and prints
    # where each of its threads is (the hang's detail)
    return job_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"), PYTHONFAULTHANDLER="1", **extra)


def _start(case: Case, folder: Path, hosts: Hosts | None) -> list[tuple[subprocess.Popen[str], int]]:
    """The job's root processes, each with the index of the host it runs on."""
    n = SIZES[case.kind]
    common = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    out: list[tuple[subprocess.Popen[str], int]] = []
    if case.kind == "ps":
        if hosts is None:
            cluster = local_ps_cluster(2, 1)
        else:
            cluster = {"chief": [f"{hosts[0].address}:2222"],
                       "worker": [f"{hosts[1].address}:2222", f"{hosts[2].address}:2222"],
                       "ps": [f"{hosts[3].address}:2222"]}
        for i, (task_type, index) in enumerate([("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
            argv = [sys.executable, str(JOB), "ps", str(folder)]
            env = _env(TF_CONFIG=tf_config, TORCH_CPP_LOG_LEVEL="ERROR")
            if hosts is None:
                out.append((subprocess.Popen(argv, env=env, start_new_session=True, **common), i))
            else:
                out.append((hosts[i].popen(argv, env=env, **common), i))
        return out
    if case.fault == "never":  # each worker started alone with its TF_CONFIG; the target never is
        if hosts is None:
            ports: set[int] = set()
            while len(ports) < n:
                ports.add(find_free_port("127.0.0.1"))
            addresses = [f"127.0.0.1:{p}" for p in sorted(ports)]
        else:
            addresses = [f"{h.address}:2222" for h in hosts]
        for i in range(n):
            if f"worker {i}" == case.target:
                continue
            tf_config = json.dumps({"cluster": {"worker": addresses[:n]}, "task": {"type": "worker", "index": i}})
            argv = [sys.executable, str(JOB), case.kind, str(folder)]
            if hosts is None:
                out.append((subprocess.Popen(argv, env=_env(TF_CONFIG=tf_config), start_new_session=True, **common), i))
            else:
                out.append((hosts[i].popen(argv, env=_env(TF_CONFIG=tf_config), **common), i))
        return out
    if case.kind == "mirrored":  # one process starts the other (no launcher)
        argv = [sys.executable, str(JOB), case.kind, str(folder)]
        return [(subprocess.Popen(argv, env=_env(), start_new_session=True, **common), 0)]
    if hosts is None:
        argv = [sys.executable, "-m", "stratagem", "run", "-n", str(n), str(JOB), case.kind, str(folder)]
        return [(subprocess.Popen(argv, env=_env(), start_new_session=True, **common), 0)]
    endpoint = f"{hosts[0].address}:29400"
    for i, h in enumerate(hosts):
        argv = [sys.executable, "-m", "stratagem", "run", "-n", "1", "--nnodes", str(n), "--node-rank", str(i),
                "--rdzv-endpoint", endpoint, str(JOB), case.kind, str(folder)]
        out.append((h.popen(argv, env=_env(), **common), i))
    return out


def _host_of(case: Case, name: str) -> int:
    if case.kind == "ps":
        return PS_TASKS.index(name)
    return int(name.split()[1])  # "worker r" / "stage r": node r runs rank r


def _line_about(text: str) -> str:
    """The line a rank printed about the failure (its last error line)."""
    lines = [ln for ln in text.splitlines()
             if ("failed" in ln or "Error" in ln or "error" in ln) and not ln.startswith(("STEP", "RANK", "stratagem run:"))]
    return lines[-1].strip() if lines else ""


def run(case: Case, warmup_steps: int = 15) -> Row:
    """Start the job, break it as ``case`` says, and judge what every process did."""
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sg-matrix-")))
        hosts = stack.enter_context(Hosts(SIZES[case.kind])) if case.hosts else None
        if case.fault == "save-cut":
            (folder / "save-every").write_text("10")
        if case.fault == "never":
            (folder / "timeout").write_text(str(NEVER_TIMEOUT))
        if case.fault == "slow":
            (folder / "width").write_text("2048")
        roots = _start(case, folder, hosts)
        outs = [_Output(p) for p, _ in roots]
        jobs = [JobProcesses(p.pid) for p, _ in roots]
        try:
            return _judge(case, folder, hosts, roots, outs, jobs, warmup_steps)
        finally:
            for p, _ in roots:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for job in jobs:  # a stopped process left behind is killed too
                for pid, _ in job.alive():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _ranks(outs: list[_Output]) -> dict[str, int]:
    found: dict[str, int] = {}
    for o in outs:
        for _, line in list(o.lines):
            m = RANK.match(line)
            if m:
                found[m.group(1)] = int(m.group(2))
    return found


def _steps(outs: list[_Output], name: str) -> int:
    return sum(1 for o in outs for _, line in list(o.lines) if line.startswith(f"STEP {name} "))


def _judge(case: Case, folder: Path, hosts: Hosts | None, roots, outs: list[_Output], jobs: list[JobProcesses],
           warmup_steps: int) -> Row:
    n = SIZES[case.kind]
    names = PS_TASKS if case.kind == "ps" else [f"{'stage' if case.kind == 'pipeline' else 'worker'} {r}" for r in range(n)]
    steppers = ["chief"] if case.kind == "ps" else names
    if case.fault == "never":  # the fault is there from the start: the others must give up in time,
        # counted from the last of them to be READY (imports done: Python and torch start in 1-10 s
        # as the machine is loaded, which is not the job's to bound)
        present = len(names) - 1
        deadline = time.monotonic() + 120
        ready: list[float] = []
        while time.monotonic() < deadline:
            ready = [t for o in outs for t, line in list(o.lines) if line.startswith("READY ")]
            if len(ready) >= present or all(p.poll() is not None for p, _ in roots):
                break
            time.sleep(0.02)
        at = max(ready) if len(ready) >= present else time.monotonic()
        return _judge_ending(case, folder, roots, outs, jobs, {}, names, at)
    # the job forms and trains (each rank has printed its pid and some steps)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for job in jobs:
            job.alive()
        ranks = _ranks(outs)
        if len(ranks) == n and all(_steps(outs, s) * 5 >= warmup_steps for s in steppers):
            break
        if any(p.poll() is not None for p, _ in roots):
            return Row(case, "did not form", detail="\n".join(o.text()[-1500:] for o in outs))
        time.sleep(0.05)
    else:
        return Row(case, "did not form", detail="\n".join(o.text()[-1500:] for o in outs))
    if case.fault == "save-cut":  # cut while a checkpoint is being written: at the next save
        def saves() -> int:
            return sum(1 for o in outs for _, line in list(o.lines) if line.startswith("SAVING"))

        seen = saves()
        while time.monotonic() < deadline + 60 and saves() == seen:
            time.sleep(0.002)
    # the fault
    at = time.monotonic()
    pid = ranks[case.target]
    if case.fault == "kill":
        os.kill(pid, signal.SIGKILL)
    elif case.fault == "stop":
        os.kill(pid, signal.SIGSTOP)
    elif case.fault in ("raise", "raise-in-step"):
        (folder / f"{case.fault}-{case.target}").touch()
    elif case.fault in ("cut", "save-cut"):
        assert hosts is not None
        hosts[_host_of(case, case.target)].cut()
    elif case.fault == "vanish":
        assert hosts is not None
        hosts[_host_of(case, case.target)].vanish()
    elif case.fault == "slow":
        assert hosts is not None
        hosts[_host_of(case, case.target)].slow("20mbit")
    else:
        raise ValueError(f"unknown fault {case.fault!r}")
    if case.carries_on:
        return _judge_carrying_on(case, folder, roots, outs, jobs, ranks, at)
    if case.fault == "slow":
        return _judge_slow(case, roots, outs, names, at)
    return _judge_ending(case, folder, roots, outs, jobs, ranks, names, at)


def _judge_slow(case: Case, roots, outs: list[_Output], names: list[str], at: float) -> Row:
    """Slow is not dead: while the link is slow no process ends and none declares a failure,
    though a step takes longer than a silent peer is waited for."""
    while time.monotonic() < at + SLOW_FOR and all(p.poll() is None for p, _ in roots):
        time.sleep(0.1)
    text = "\n".join(o.text() for o in outs)
    gaps = []
    end = time.monotonic()
    for o in outs:
        stamps = [ts for ts, line in list(o.lines) if line.startswith("STEP") and ts >= at - 1]
        gaps += [b - a for a, b in zip(stamps, stamps[1:])]
        if stamps:  # a step still under way when the window closed is slow too (it may take longer)
            gaps.append(end - stamps[-1])
    longest = max(gaps, default=0.0)
    row = Row(case, "ok", {"longest step while slow": longest}, {})
    if any(p.poll() is not None for p, _ in roots) or "failed" in text:
        row.outcome, row.detail = "wrong diagnosis", "a slow link was taken for a dead one\n" + text[-3000:]
    elif longest < 6.0:
        row.outcome, row.detail = "not tested", f"the steps took at most {longest:.1f}s: the link was not slow"
    return row


def _judge_ending(case: Case, folder: Path, roots, outs: list[_Output], jobs: list[JobProcesses],
                  ranks: dict[str, int], names: list[str], at: float) -> Row:
    """Every process of the job ends within the bound, the others naming the lost one."""
    ended: dict[int, float] = {}
    alive: set[int] = set()
    while time.monotonic() < at + case.bound + SLACK:
        alive = set()
        for job in jobs:
            alive |= {p for p, _ in job.alive()}
        for job in jobs:
            for p in job.known:
                if p not in alive and p not in ended:
                    ended[p] = time.monotonic() - at
        if not alive or (case.fault == "stop" and case.kind == "ps" and alive == {ranks[case.target]}):
            break
        time.sleep(0.02)
    hung = set(alive)
    for p in hung:  # where they are stuck: faulthandler prints every thread's stack
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGABRT)
    for o in outs:
        o.reader.join(timeout=5 if hung else 2)
    by_pid = {p: name for name, p in ranks.items()}
    for root, h in roots:
        if root.pid not in by_pid:  # a launcher, or (started alone) the rank itself before it said so
            alone = case.kind == "ps" or case.fault == "never"
            by_pid[root.pid] = (PS_TASKS[h] if case.kind == "ps" else names[h]) if alone else f"launcher {h}"
    times: dict[str, float | None] = {}
    for job in jobs:
        for p in job.known:
            if p in by_pid:
                times[by_pid[p]] = ended.get(p)
    text = "\n".join(o.text() for o in outs)
    says = {name: _line_about(_rank_text(roots, outs, name, case)) for name in names if name != case.target}
    launcher = [line for o in outs for _, line in o.lines if line.startswith("stratagem run:")]
    if launcher:
        says["launcher"] = launcher[-1]
    row = Row(case, "ok", times, says)
    if case.fault == "stop" and case.kind == "ps":
        # no launcher: a stopped task stays stopped until its cluster manager sees to it; the others leave
        times[f"{case.target} (stopped)"] = times.pop(case.target, None)
    judged = {k: v for k, v in times.items() if not k.endswith("(stopped)")}
    late = {k: v for k, v in judged.items()
            if v is None or v > (LAUNCHER_BOUND if k.startswith("launcher") and not case.hosts else case.bound)}
    if any(v is None for v in judged.values()):
        row.outcome, row.detail = "hang", f"still running {case.bound + SLACK:g}s after the fault: {late}\n{text[-12000:]}"
    elif late:
        row.outcome, row.detail = "over bound", f"{late}\n{text[-3000:]}"
    else:
        wrong = _wrong(case, says, text)
        if wrong:
            row.outcome, row.detail = "wrong diagnosis", f"{wrong}\n{text[-3000:]}"
    if case.fault == "save-cut" and row.outcome == "ok":
        row.detail = _checkpoints_intact(folder / "ckpt")
        if row.detail:
            row.outcome = "data lost"
    return row


def _rank_text(roots, outs: list[_Output], name: str, case: Case) -> str:
    """What one rank printed: the output of the process started for it (one per host, or per
    task), or, under one launcher on this host, everything the job printed."""
    if len(roots) == 1 and case.kind != "ps" and case.fault != "never":  # one `stratagem run`: a rank's one-line report starts "stratagem: rank R:"
        tag = f"stratagem: rank {name.split()[-1]}:"
        # from the tag on: the ranks share the launcher's stderr, so a line may land after part
        # of another rank's output
        return "\n".join(line[line.index(tag):] for _, line in outs[0].lines if tag in line)
    i = _host_of(case, name)
    return next((o.text() for (_, h), o in zip(roots, outs) if h == i), "")


def _wrong(case: Case, says: dict[str, str], text: str) -> str:
    t = case.target
    r = t.split()[-1]
    if case.fault == "never":  # the one that never came, by its name or its address
        address = f"10.77.0.{int(r) + 1}" if case.hosts else "127.0.0.1"
        if not any(t in line or f"rank {r}" in line or address in line for line in says.values()):
            return f"no process said {t} never came: {says}"
        return ""
    if case.kind == "ps":
        if case.target == "ps 0" and "ps:0" not in text and "ps 0" not in text:
            return "nobody named the lost ps task"
        return ""
    ranks = {k: v for k, v in says.items() if k != "launcher"}
    quiet = [k for k, v in ranks.items() if f"worker {r} failed" not in v and f"stage {r} failed" not in v]
    if quiet:
        return f"{', '.join(quiet)} did not name {t}: {says}"
    if case.hosts and "is gone: killed or crashed" in text:
        return "'process gone' for a peer on another host"
    if case.fault == "stop" and "stopped" not in text:
        return "a stopped process not called stopped"
    return ""


def _judge_carrying_on(case: Case, folder: Path, roots, outs: list[_Output], jobs, ranks, at: float) -> Row:
    """Under ParameterServerStrategy: the chief says the worker failed, within the bound, and
    goes on; then it is told to finish and every task ends cleanly."""
    chief = outs[0]
    noticed = None
    who = case.target.replace(" ", ":")
    while time.monotonic() < at + case.bound + SLACK:
        hit = [ts for ts, line in list(chief.lines) if f"stratagem: {who} failed" in line]
        if hit:
            noticed = hit[0] - at
            break
        if roots[0][0].poll() is not None:
            break
        time.sleep(0.02)
    went_on = False
    if noticed is not None:
        before = _steps(outs, "chief")
        t = time.monotonic()
        while time.monotonic() < t + 10 and not went_on:
            went_on = _steps(outs, "chief") >= before + 2
            time.sleep(0.05)
    (folder / "finish-chief").touch()
    times: dict[str, float | None] = {"chief notices": noticed}
    says = {"chief": next((line for _, line in chief.lines if f"{who} failed" in line), "")}
    row = Row(case, "ok", times, says)
    if noticed is None:
        row.outcome, row.detail = "hang", chief.text()[-3000:]
    elif noticed > case.bound:
        row.outcome, row.detail = "over bound", chief.text()[-3000:]
    elif not went_on:
        row.outcome, row.detail = "wrong diagnosis", "the chief did not go on\n" + chief.text()[-3000:]
    # told to finish, every task still running ends cleanly (the lost one's host may be cut off)
    t = time.monotonic()
    lost = _host_of(case, case.target) if case.hosts or case.kind == "ps" else None
    others = [p for i, (p, _) in enumerate(roots) if i != lost]
    while time.monotonic() < t + 30 and any(p.poll() is None for p in others):
        time.sleep(0.05)
    codes = {PS_TASKS[i]: p.poll() for i, (p, _) in enumerate(roots) if i != lost}
    times["the others end after finishing"] = time.monotonic() - t
    if row.outcome == "ok" and any(c != 0 for c in codes.values()):
        row.outcome = "leftover" if None in codes.values() else "unclear error"
        row.detail = f"exit codes after finishing: {codes}\n" + "\n".join(o.text()[-1500:] for o in outs)
    return row


def _checkpoints_intact(directory: Path) -> str:
    """"" when every checkpoint left in sight is whole and the newest restores (into the same
    model, in this process); else what is wrong. A save cut off may leave hidden parts, which
    the next writer removes: not a loss."""
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    import stratagem as sg  # noqa: PLC0415
    from stratagem.train.checkpoint.files import verify  # noqa: PLC0415

    if not directory.exists():
        return "no checkpoint was written"
    done = [p for p in directory.iterdir() if not p.name.startswith(".")]
    bad = [p.name for p in done if not re.fullmatch(r"ckpt-\d+", p.name)]
    if bad:
        return f"partial checkpoints in sight: {bad}"
    if not done:
        return "no complete checkpoint"
    for p in done:
        try:
            verify(p)
        except Exception as e:  # noqa: BLE001
            return f"{p.name} does not verify: {e}"
    model = nn.Sequential(nn.Linear(8, 16), nn.Identity(), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = sg.CheckpointManager(sg.Checkpoint(model=model, optimizer=opt), directory)
    try:
        restored = manager.restore_or_initialize()
    except Exception as e:  # noqa: BLE001
        return f"the newest checkpoint does not restore: {type(e).__name__}: {e}"
    finally:
        manager.close()
    newest = max(done, key=lambda p: int(p.name.split("-")[1]))
    if restored is None or Path(restored).name != newest.name:
        return f"restored {restored}, not the newest {newest.name}"
    return ""


ONE_HOST = [Case(kind, fault, f"{'stage' if kind == 'pipeline' else 'worker'} {t}")
            for kind in ("mirrored", "multiworker", "sharded", "pipeline")
            for fault in ("raise", "raise-in-step", "kill", "stop")
            for t in ((0, 1, 2) if kind == "pipeline" else (0, 1))]
PS_ONE_HOST = [Case("ps", f, t) for f, t in [
    ("kill", "worker 1"), ("stop", "worker 1"), ("raise-in-step", "worker 1"),
    ("kill", "ps 0"), ("stop", "ps 0"), ("raise", "chief"), ("kill", "chief"), ("stop", "chief"),
]]
ACROSS_HOSTS = ([Case(kind, fault, f"{'stage' if kind == 'pipeline' else 'worker'} {t}", hosts=True)
                 for kind in ("multiworker", "sharded", "pipeline")
                 for fault in ("cut", "vanish") for t in (0, 1)]
                + [Case("ps", f, t, hosts=True) for f, t in [
                    ("cut", "worker 1"), ("vanish", "worker 1"), ("cut", "ps 0"), ("vanish", "ps 0"),
                    ("cut", "chief"), ("vanish", "chief")]]
                + [Case(kind, "save-cut", "worker 1", hosts=True) for kind in ("multiworker", "sharded")]
                + [Case(kind, "slow", "worker 1", hosts=True) for kind in ("multiworker", "sharded")])
NEVER = [Case("multiworker", "never", "worker 1"), Case("multiworker", "never", "worker 1", hosts=True),
         Case("multiworker", "never", "worker 0", hosts=True)]
CASES = ONE_HOST + PS_ONE_HOST + ACROSS_HOSTS + NEVER


def expected(case: Case) -> str:
    """What a case must see, in a few words (the table's "expected" column)."""
    if case.fault == "slow":
        return "no process ends or declares a failure while the link is slow"
    if case.fault == "never":
        return f"the others give up within {case.bound:g} s, naming {case.target}"
    if case.carries_on:
        return f"the chief names {case.target} as failed and goes on"
    extra = "; every checkpoint in sight whole, the newest restores" if case.fault == "save-cut" else ""
    return f"every process ends, the others naming {case.target}; nothing left running{extra}"


def cells(r: Row) -> Any:
    """The row in the table's columns (tests/faults/matrix_table.py)."""
    from matrix_table import Cells  # noqa: PLC0415

    times = ", ".join(f"{k} {_secs(v)}" for k, v in r.times.items())
    said = "; ".join(f"{k}: `{v[:110]}`" for k, v in r.says.items() if v)
    return Cells(r.case.name, expected(r.case), f"{r.case.bound:g} s", times, r.outcome, said)


def table(rows: list[Row]) -> str:
    """The rows as docs/MULTIWORKER.md shows them (its one table also holds the one-process
    matrix's rows: tests/faults/matrix_table.py)."""
    from matrix_table import HEADER  # noqa: PLC0415

    return "\n".join([HEADER, *(cells(r).line() for r in rows)])


def main() -> None:
    wanted = sys.argv[1:]
    cases = [c for c in CASES if not wanted or any(w in c.name for w in wanted)]
    if any(c.hosts for c in cases) and hosts_mod.unavailable():
        raise SystemExit(f"cannot make hosts here: {hosts_mod.unavailable()}")
    rows = []
    for c in cases:
        rows.append(run(c))
        print(rows[-1], flush=True)
        if rows[-1].outcome != "ok":
            print(rows[-1].detail, flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
