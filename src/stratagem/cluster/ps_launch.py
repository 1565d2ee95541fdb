"""Run a parameter-server cluster on this machine: a chief, N workers and P ps tasks, watched to the end.

``stratagem run --workers N --ps P script.py`` uses it. Every task runs the same command with
``TF_CONFIG`` (the cluster on 127.0.0.1 with free ports, its task) and
``STRATAGEM_RESTART_COUNT``. The chief decides: the job's exit code is the chief's, and after it
exits the others get ``grace`` seconds to end by themselves (they do when the chief shuts the
cluster down), then SIGTERM, then SIGKILL. A worker that fails is started again (same TF_CONFIG,
restart count + 1) up to ``max_restarts`` times, after which the job goes on without it. A ps task
that fails takes its variables with it: the chief raises, naming the last checkpoint the job saved,
and (as TensorFlow's guide has the user do by hand) the whole cluster is started again, every task
with restart count + 1, up to ``max_restarts`` times, so that a script which restores its last
checkpoint (``CheckpointManager.restore_or_initialize``, ``BackupAndRestore``) goes on from there;
with no restart left the job ends. Children die with the launcher (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType

from stratagem.cluster.launch import die_with_parent, find_free_port
from stratagem.cluster.ps_spec import EXIT_CHIEF_LOST

#: seconds between SIGTERM and SIGKILL when the launcher stops a task
TERMINATE_WAIT = 5.0

#: variables another launcher may have left in the environment; a task of this cluster reads
#: only TF_CONFIG, so they are removed from its environment
FOREIGN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "STRATAGEM_LAUNCHER", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def local_ps_cluster(num_workers: int, num_ps: int, host: str = "127.0.0.1") -> dict[str, list[str]]:
    """TF_CONFIG's ``cluster`` for a chief, ``num_workers`` workers and ``num_ps`` ps tasks on
    ``host``, each at a port that is free now."""
    if num_workers < 1 or num_ps < 1:
        raise ValueError(
            f"a parameter-server cluster needs --workers >= 1 and --ps >= 1, got --workers "
            f"{num_workers} --ps {num_ps}"
        )
    ports: set[int] = set()
    while len(ports) < 1 + num_workers + num_ps:  # the OS may hand out a port twice
        ports.add(find_free_port(host))
    addresses = [f"{host}:{port}" for port in sorted(ports)]
    return {
        "chief": addresses[:1],
        "worker": addresses[1 : 1 + num_workers],
        "ps": addresses[1 + num_workers :],
    }


def task_environ(cluster: Mapping[str, Sequence[str]], task_type: str, index: int, restart_count: int = 0) -> dict[str, str]:
    """The variables that make a process task ``task_type:index`` of ``cluster``."""
    config = {"cluster": {k: list(v) for k, v in cluster.items()}, "task": {"type": task_type, "index": index}}
    return {"TF_CONFIG": json.dumps(config), "STRATAGEM_RESTART_COUNT": str(restart_count)}


#: seconds a task that left because it found the chief gone or failed (EXIT_CHIEF_LOST) waits for
#: the chief to end before it counts as failed (a failing chief tells its tasks first, then
#: writes its traceback and ends: about a second)
CHIEF_DECIDES_S = 5.0

#: seconds the other tasks get to end by themselves after the chief failed: it told them before
#: it ended, and each says in one line that it leaves; one still running then is stopped (and the
#: launcher says so), so that every task of a failed job has ended within a few seconds
TOLD_TO_LEAVE_S = 3.0

@dataclass
class _Task:
    task_type: str
    index: int
    proc: subprocess.Popen[bytes]
    restarts: int = 0
    done: bool = False  # exited, and will not be started again
    left_at: float | None = None  # when it exited with EXIT_CHIEF_LOST while the chief still ran

    @property
    def name(self) -> str:
        return "chief" if self.task_type == "chief" else f"{self.task_type} {self.index}"


class _RestartJob(Exception):
    """A ps task failed, the chief has ended, and the whole job is to start again."""


class _Stopped(Exception):
    """The launcher was asked to stop (SIGTERM)."""


def _say(line: str) -> None:
    sys.stderr.write(f"stratagem run: {line}\n")
    sys.stderr.flush()


def exit_status(code: int) -> int:
    """A process's return code as a command's exit status (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


@dataclass
class PSJob:
    """Start the cluster's tasks, watch them, and return the job's exit code (:meth:`run`)."""

    command: Sequence[str]  # what every task runs: [python, script, args...]
    num_workers: int
    num_ps: int
    grace: float = 30.0  # seconds the others get to end after the chief exited 0
    max_restarts: int = 0  # per worker (it rejoins the running cluster), and for the whole job after a ps task failed
    environ: Mapping[str, str] | None = None  # the tasks' base environment (default: os.environ)
    poll: float = 0.1
    say: Callable[[str], None] = _say  # one line about the job, as "stratagem run: <line>"
    cluster: dict[str, list[str]] = field(default_factory=dict)  # filled in by run()
    job_restarts: int = 0  # times the whole cluster was started again after a ps task failed

    def __post_init__(self) -> None:
        if self.grace < 0:
            raise ValueError(f"--grace-period must be >= 0 seconds, got {self.grace}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        self._own_cluster = not self.cluster
        if not self.cluster:
            self.cluster = local_ps_cluster(self.num_workers, self.num_ps)

    def _start(self, task_type: str, index: int, restarts: int = 0) -> subprocess.Popen[bytes]:
        env = dict(os.environ if self.environ is None else self.environ)
        for k in FOREIGN_VARS:
            env.pop(k, None)
        if "OMP_NUM_THREADS" not in env:
            # the tasks on this machine split its cores, as `stratagem run -n N` replicas do
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (1 + self.num_workers + self.num_ps)))
        # torch.distributed.rpc's C++ agent logs every connection a lost task closes; the
        # coordinator reports a lost worker in one line instead
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env.update(task_environ(self.cluster, task_type, index, restarts))
        env["STRATAGEM_WORKER_RESTARTS"] = str(self.max_restarts)  # the chief waits for restarted workers
        return subprocess.Popen(list(self.command), env=env, preexec_fn=die_with_parent)

    def run(self) -> int:
        """Run the job to its end; the chief's exit code (1 when a ps task failed; 130 or 143 when
        the launcher was interrupted or terminated: the tasks are stopped first)."""
        tasks: list[_Task] = []
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _raise_stopped)
        try:
            while True:
                tasks.clear()
                self._start_all(tasks)
                try:
                    return self._watch(tasks)
                except _RestartJob:
                    pass
                # a ps task failed and every task was stopped: all start again (on new ports when
                # this launcher chose them: the old ones may still be held)
                if self._own_cluster:
                    self.cluster = local_ps_cluster(self.num_workers, self.num_ps)
        except KeyboardInterrupt:
            _stop([t.proc for t in tasks])
            return 128 + signal.SIGINT
        except _Stopped:
            _stop([t.proc for t in tasks])
            return 128 + signal.SIGTERM
        finally:
            _stop([t.proc for t in tasks])  # nothing is left running, whatever happened
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _start_all(self, tasks: list[_Task]) -> None:
        """Start the chief, the workers and the ps tasks into ``tasks`` (each as it starts: a
        failed start leaves the started ones there, to be stopped)."""
        n = self.job_restarts
        tasks.append(_Task("chief", 0, self._start("chief", 0, n)))
        for task_type, count in (("worker", self.num_workers), ("ps", self.num_ps)):
            for i in range(count):
                tasks.append(_Task(task_type, i, self._start(task_type, i, n)))

    def _watch(self, tasks: list[_Task]) -> int:
        chief = tasks[0]
        while True:
            code = chief.proc.poll()
            if code is not None:
                return self._after_chief(tasks, code)
            for task in tasks[1:]:
                code = task.proc.poll()
                if task.done or code is None:
                    continue
                if chief.proc.poll() is not None:  # it ended since the look above: it decides
                    break
                if code == 0:  # a task that finished (a ps or worker told to stop by the chief)
                    task.done = True
                    continue
                if code == EXIT_CHIEF_LOST:
                    # it left because it found the chief gone or failed: the chief's end (its
                    # traceback is still being written, say) is the job's, and this is no news;
                    # only a chief still running CHIEF_DECIDES_S later makes it a failure
                    task.left_at = task.left_at or time.monotonic()
                    if time.monotonic() - task.left_at < CHIEF_DECIDES_S:
                        continue
                    task.left_at = None
                if task.task_type == "ps":
                    again = self.job_restarts < self.max_restarts
                    if again:
                        self.job_restarts += 1
                        self.say(f"{task.name} failed (exit code {code}); starting the whole job again "
                                 f"({self.job_restarts} of {self.max_restarts} restarts), to go on from "
                                 "its last checkpoint")
                    else:
                        self.say(f"{task.name} failed (exit code {code})")
                    # the chief sees the lost variables in its next call: let it say so, bounded
                    deadline = time.monotonic() + self.grace
                    while chief.proc.poll() is None and time.monotonic() < deadline:
                        time.sleep(self.poll)
                    _stop([t.proc for t in tasks])
                    if again:
                        raise _RestartJob()
                    return 1
                elif task.restarts < self.max_restarts:
                    task.restarts += 1
                    self.say(f"{task.name} failed (exit code {code}); restarting it ({task.restarts} of {self.max_restarts})")
                    task.proc = self._start(task.task_type, task.index, self.job_restarts + task.restarts)
                else:
                    task.done = True
                    self.say(
                        f"{task.name} failed (exit code {code}); not restarting it ({task.restarts} of "
                        f"{self.max_restarts} restarts used), the job goes on without it"
                    )
            time.sleep(self.poll)

    def _after_chief(self, tasks: list[_Task], code: int) -> int:
        others = [t for t in tasks[1:] if t.proc.poll() is None]
        if code != 0:
            self.say(f"chief failed (exit code {code})")
            wait = min(self.grace, TOLD_TO_LEAVE_S)
            deadline = time.monotonic() + wait
            while others and time.monotonic() < deadline:
                time.sleep(min(self.poll, max(0.0, deadline - time.monotonic())))
                others = [t for t in others if t.proc.poll() is None]
            for t in others:
                self.say(f"{t.name} was still running {wait:g}s after the chief failed; stopping it")
            _stop([t.proc for t in others])
            return exit_status(code)
        deadline = time.monotonic() + self.grace
        while others and time.monotonic() < deadline:
            time.sleep(min(self.poll, max(0.0, deadline - time.monotonic())))
            others = [t for t in others if t.proc.poll() is None]
        for t in others:
            self.say(f"{t.name} was still running {self.grace:g}s after the chief exited; stopping it")
        _stop([t.proc for t in others])
        return 0


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped()


def _stop(procs: Sequence[subprocess.Popen[bytes]], wait: float = TERMINATE_WAIT) -> None:
    """SIGTERM every process still running, then SIGKILL those alive ``wait`` seconds later."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + wait
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(wait)
            except subprocess.TimeoutExpired:  # not even SIGKILL ended it (a hung device?): leave it
                pass
