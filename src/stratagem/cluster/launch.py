"""Start the other replicas of a plain ``python train.py`` by re-running the script, and watch them.

Lightning Fabric's subprocess launcher does the same: the process the user started becomes
rank 0, and ranks 1..N-1 are the same command line with RANK/WORLD_SIZE/MASTER_* set. A child
dies with its parent (PR_SET_PDEATHSIG); the parent's watcher notices a child that fails, and if
the parent does not stop by itself within ``grace`` seconds (say it is not in a collective) it
is stopped with exit code 1, so the command never hangs.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from stratagem.cluster.spec import ClusterSpec
from stratagem.cluster.stopping import mark_reported, reported
from stratagem.cluster.store_keeper import start_keeper

_PR_SET_PDEATHSIG = 1


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def relaunch_command(argv: Sequence[str] | None = None) -> list[str]:
    """The command line that re-runs this program: ``python script.py args`` or ``python -m mod``."""
    argv = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__",):
        name = spec.name
        if name.endswith(".__main__"):
            name = name[: -len(".__main__")]
        return [sys.executable, "-m", name, *argv[1:]]
    if not argv or argv[0] in ("", "-c") or not os.path.exists(argv[0]) or _in_notebook_or_ipython(argv):
        raise RuntimeError(
            "this program cannot be re-run to start the other replicas (it is a notebook, an "
            f"interactive session or `python -c`; sys.argv={argv!r}). From a notebook or a REPL, "
            "put the training in a function and run `sg.launch(train_fn, num_replicas=N)`: it "
            "starts the replicas as fresh processes, each making the strategy inside train_fn, "
            "and returns rank 0's result (`pip install 'stratagem[launch]'` for a function "
            "defined in the notebook itself). From a script: `stratagem run -n N script.py`, "
            "or torchrun"
        )
    return [sys.executable, *argv]


def _in_notebook_or_ipython(argv: Sequence[str]) -> bool:
    """A Jupyter kernel or an IPython shell: its argv[0] (ipykernel_launcher.py, bin/ipython) is
    a file, but running it again starts another kernel on the same ports (which kills the
    notebook's) or an interactive shell, not this program."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    if get_ipython is None or get_ipython() is None:
        return False
    return os.path.basename(argv[0]).startswith(("ipykernel", "ipython", "jupyter"))


class ReplicaProcesses:
    """The children this process started (ranks 1..N-1), watched until they exit."""

    def __init__(
        self,
        procs: list[subprocess.Popen[bytes]],
        grace: float,
        on_failure: Callable[[int, int], None] | None = None,
        *,
        tolerate: bool = False,
        restarts: int = 0,
        restart: Callable[[int], subprocess.Popen[bytes]] | None = None,
        outlive: bool = False,
    ) -> None:
        self.procs = procs
        #: the children go on when this process (rank 0) is lost: the job's store is outside it
        #: (a store keeper), so at its exit they are waited for, however long the training takes
        #: them, not stopped (but after a Ctrl-C, as always)
        self.outlive = outlive
        self.grace = grace
        self.on_failure = on_failure
        #: the job goes on without a failed child (``FailureOptions(on_failure="continue")``):
        #: its failure is remembered (to name it), not ended by stopping everyone
        self.tolerate = tolerate
        self.failed: tuple[int, int] | None = None  # (rank, exit code)
        #: the children that failed while the job went on (``tolerate``)
        self.lost: dict[int, int] = {}
        #: how many more times a lost child is started again (``tolerate``), and how
        self.restarts = restarts
        self._restart = restart
        #: the children started again (ranks)
        self.replacements: set[int] = set()
        #: how long a child started again may take to end once rank 0 has ended: it ends with the
        #: others when it was let in; one still coming back when the training ended is stopped
        self.replacement_wait = 5.0
        #: how long to wait for the children after rank 0 crashed (they may be reporting)
        self.crash_wait = 2.0
        #: how long to wait for them after rank 0 was interrupted (Ctrl-C) before stopping them:
        #: short, as they cannot go on without rank 0. Those the Ctrl-C reached too are raising
        #: already, and a SIGTERM lets them finish saying why (``stopping``); the others (``kill
        #: -INT`` of rank 0 alone) then each say in one line that they were stopped. Every process
        #: of the job must end within seconds of the stop (tests/faults/test_interrupts.py).
        self.interrupt_wait = 0.25
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stratagem-replica-watch", daemon=True)
        self._thread.start()
        self._crashed = False
        self._interrupted = False
        previous = sys.excepthook

        def excepthook(*exc: Any) -> None:
            self._crashed = True  # rank 0 is dying: do not wait long for its children
            # Ctrl-C (or kill -INT of this process): the children cannot finish the job without
            # rank 0, and those that got the interrupt too are ending by themselves
            self._interrupted = issubclass(exc[0], KeyboardInterrupt)
            previous(*exc)

        sys.excepthook = excepthook
        atexit.register(self.shutdown)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for rank, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code not in (None, 0) and self.tolerate:
                    if self.restarts > 0 and self._restart is not None:
                        self.restarts -= 1  # started again: it comes back into the running job
                        self.failed = (rank, code)
                        self.procs[rank - 1] = self._restart(rank)
                        self.replacements.add(rank)
                    elif rank not in self.lost:
                        self.lost[rank] = code
                        self.failed = (rank, code)  # named by launcher_probe; the job goes on
                    continue
                if code not in (None, 0) and self.failed is None:
                    self.failed = (rank, code)
                    if self.on_failure is not None:
                        self.on_failure(rank, code)
                    self._stop.wait(self.grace)
                    if self._stop.is_set():
                        return
                    sys.stderr.write(
                        f"stratagem: replica {rank} exited with code {code}; "
                        f"rank 0 did not stop within {self.grace:.0f}s, stopping it\n"
                    )
                    sys.stderr.flush()
                    mark_reported()
                    self.kill()
                    os._exit(1)
            if all(p.poll() is not None for p in self.procs) and (self.failed is None or self.tolerate):
                return

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()

    def shutdown(self, wait: float = 30.0) -> None:
        """At exit: give the children ``wait`` seconds to finish, then stop them.

        If rank 0 ends normally but a child failed, the command still exits non-zero.
        """
        if not self.tolerate:
            self._stop.set()
        if self._interrupted:
            wait = self.interrupt_wait
        elif self.outlive:  # rank 0 ended (or failed): the others finish the training without it
            wait = float("inf")
        elif self._crashed:
            wait = self.crash_wait
        deadline = time.monotonic() + wait
        late: list[int] = []
        for rank, p in enumerate(list(self.procs), start=1):
            try:
                if rank in self.replacements and not self._crashed:
                    p.wait(min(self.replacement_wait, max(0.0, deadline - time.monotonic())))
                else:
                    p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if rank not in self.replacements:
                    break
                late.append(rank)
                p.kill()  # came back too late: the training it would join has ended
                p.wait()
        for rank in late:
            sys.stderr.write(f"stratagem: replica {rank} was started again too late to rejoin "
                             "(the training had ended); it was stopped\n")  # fmt: skip
            self.lost[rank] = 0
        # a child started again by the watcher thread dies with that thread (PR_SET_PDEATHSIG
        # follows the thread that forked): it is stopped only once the children have ended
        self._stop.set()
        self.kill()
        failed = [(r, p.returncode) for r, p in enumerate(self.procs, start=1) if p.returncode and r not in self.lost]
        if self.tolerate:
            # the job went on without the replicas lost meanwhile: rank 0's own end is the job's
            self.failed = failed[0] if failed else None
        if failed and not self._crashed and self.failed is None:
            self.failed = failed[0]
        if self.failed is not None and not self._crashed:
            rank, code = self.failed
            if not reported():  # rank 0 has not already said which replica failed
                sys.stderr.write(f"stratagem: replica {rank} failed (exit code {code})\n")
                mark_reported()
            sys.stderr.flush()
            os._exit(1)


_children: ReplicaProcesses | None = None
#: the job this process started (a later strategy of the same size joins it again)
_started: ClusterSpec | None = None


def ensure_replicas(
    num_replicas: int | None,
    *,
    grace: float = 60.0,
    environ: dict[str, str] | None = None,
    tolerate: bool = False,
    restarts: int = 0,
) -> ClusterSpec:
    """This process's place in a job of ``num_replicas`` processes, starting the others if needed.

    Joins the job a launcher (torchrun, ``stratagem run``) set up; otherwise re-runs this script
    ``num_replicas - 1`` times with the launch variables set and becomes rank 0. A second
    strategy of the same size in this process is in the job already started (as the replicas
    the script started are, by their launch variables). ``tolerate``: a replica that fails is
    not a reason to stop the others (the job goes on without it: ``on_failure="continue"``),
    and one is started again up to ``restarts`` times in all (``STRATAGEM_REPLACEMENT=1``: it
    comes back into the running job).
    """
    global _children, _started
    env = ClusterSpec.from_environ(environ)
    if env is not None:
        if num_replicas is not None and env.world_size != num_replicas:
            raise RuntimeError(
                f"this process was launched as rank {env.rank} of WORLD_SIZE={env.world_size}, "
                f"but the strategy asks for {num_replicas} replicas; make them agree "
                f"(e.g. `stratagem run -n {num_replicas} ...`) or pass num_replicas=None"
            )
        return env
    if num_replicas is None or num_replicas == 1:
        return ClusterSpec.single()
    if _started is not None:
        if _started.world_size == num_replicas:
            return _started
        raise RuntimeError(
            f"an earlier strategy in this process started a job of {_started.world_size} replicas; "
            f"a strategy of {num_replicas} cannot start another: make them agree, or launch the "
            "job of the size you need with `stratagem run -n N ...`"
        )
    cmd = relaunch_command()
    port = find_free_port()
    base = dict(os.environ)
    # a job that goes on without lost replicas keeps its store outside them (a keeper), so rank 0
    # can be lost like any other: its children then do not die with it
    keeper = start_keeper("127.0.0.1", port, num_replicas) if tolerate else None
    spec = dataclasses.replace(ClusterSpec.local(0, num_replicas, port), launcher_store=keeper is not None)

    def spawn(rank: int, again: bool = False) -> subprocess.Popen[bytes]:
        env = {**base, **dataclasses.replace(spec, rank=rank, local_rank=rank).to_environ()}
        if again:
            env["STRATAGEM_REPLACEMENT"] = "1"
        if keeper is None:
            return subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
        return subprocess.Popen(cmd, env=env, pass_fds=(keeper.fd,))

    procs = [spawn(rank) for rank in range(1, num_replicas)]
    if keeper is not None:
        keeper.wait_listening("127.0.0.1", port, timeout=60.0)
    _children = ReplicaProcesses(procs, grace, tolerate=tolerate, restarts=restarts,
                                 restart=lambda rank: spawn(rank, again=True),
                                 outlive=keeper is not None)  # fmt: skip
    _started = spec
    return _started


def children() -> ReplicaProcesses | None:
    """The replicas this process started, if it started any."""
    return _children
