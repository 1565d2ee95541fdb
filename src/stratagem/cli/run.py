"""``stratagem run``: launch a script as N replicas on this machine, or as one node of many, or as
a parameter-server cluster on this machine.

Built on torch's elastic agent (``torch.distributed.run``): this module only turns our options
into its argument list. One node: ``stratagem run -n 2 train.py``; two machines:
``stratagem run -n 2 --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 train.py`` on the
first and ``--node-rank 1`` on the second. Gloo is pinned to the interface that holds ``--bind``
(default: 127.0.0.1 on one node, else the address this machine reaches the endpoint from).
torch.distributed has no authentication: run it only on a network you trust.
A parameter-server cluster: ``stratagem run --workers 2 --ps 1 train.py`` (``cluster.ps_launch``).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from stratagem.cluster.launch import find_free_port
from stratagem.cluster.ps_launch import PSJob
from stratagem.cluster.resolvers import split_address
from stratagem.cluster.stopping import first_failure
from stratagem.core import stop_guard
from stratagem.core.procs import pid_alive

#: what ``stratagem run --help`` prints above the options (plain text: argparse shows it as is)
DESCRIPTION = """\
Launch a script as N replicas (processes) on this machine, or as one node of a job on many,
or as a parameter-server cluster (a chief, workers and ps tasks) on this machine.

Built on torch's elastic agent (torch.distributed.run). A failing replica stops every other
one with an error naming it, and the command exits non-zero.

With --workers N --ps P every task gets TF_CONFIG (the cluster, its task) and
STRATAGEM_RESTART_COUNT. The exit code is the chief's; after the chief exits the others get
--grace-period seconds to end (3 s at most after a failed chief: it told them to leave), then are
stopped. A failing worker does not end the job: the chief
runs its functions on the other workers. A failing ps task takes its variables with it: the chief
gets --grace-period seconds to say what it lost, then the job ends. Nothing is restarted by
default; with --max-restarts N a failed worker is started again up to N times and rejoins the
running cluster (the chief takes it back and sends it functions again), and after a failed ps task
the whole job is started again, up to N times, to go on from the checkpoint the script restores
(CheckpointManager.restore_or_initialize, BackupAndRestore).

examples:
  stratagem run -n 2 train.py --lr 0.1          2 replicas on this machine
  stratagem run -n 2 --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 train.py
                                                machine 0 of 2 (machine 1: --node-rank 1)
  stratagem run --workers 2 --ps 1 train.py     a chief, 2 workers and 1 ps task on this machine

Gloo is pinned to the interface that holds --bind (default: 127.0.0.1 on one node, else the
address this machine reaches the endpoint from). torch.distributed has no authentication:
run it only on a network you trust.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run",
        help="run a script on N replicas (processes), on this machine or as one node of many",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-n", "--nproc-per-node", "--replicas", dest="nproc", type=int, default=None,
                   help="replicas (processes) on this machine (default 1)")
    p.add_argument("--workers", type=int, default=None,
                   help="a parameter-server cluster on this machine: a chief, this many workers and "
                        "--ps ps tasks (TF_CONFIG set for each)")
    p.add_argument("--ps", type=int, default=None, help="the number of ps tasks (with --workers)")
    p.add_argument("--grace-period", type=float, default=None,
                   help="with --workers/--ps: seconds the other tasks get to end after the chief "
                        "exited before they are stopped (default 30)")
    p.add_argument("--nnodes", type=int, default=1, help="number of machines (default 1)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this machine's index 0..nnodes-1 (fixed ranks: node i runs ranks "
                        "i*n..i*n+n-1); without it the rendezvous assigns node ranks")
    p.add_argument("--rdzv-endpoint", default=None,
                   help="host:port of the rendezvous (the first machine); default on one node: "
                        "127.0.0.1 and a free port")
    p.add_argument("--rdzv-id", default="stratagem", help="job id shared by every node")
    p.add_argument("--bind", default=None,
                   help="this machine's address to communicate on (its interface carries gloo "
                        "traffic); default 127.0.0.1 on one node")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="restart every worker up to this many times after a failure (default 0; "
                        "with --workers/--ps: each failed worker, which rejoins the cluster, and the whole job "
                        "after a ps task failed); reloading state is the script's job "
                        "(CheckpointManager.restore_or_initialize)")
    p.add_argument("--monitor-interval", type=float, default=0.5,
                   help="seconds between the agent's checks of its workers")
    p.add_argument("-m", "--module", action="store_true", help="run a module (python -m) instead")
    p.add_argument("script", help="the script (or module with -m) to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p  # type: ignore[no-any-return]


def torchrun_args(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The ``torch.distributed.run`` argument list and the environment additions for ``args``."""
    nproc = 1 if args.nproc is None else args.nproc
    max_restarts = 0 if args.max_restarts is None else args.max_restarts
    if nproc < 1 or args.nnodes < 1:
        raise ValueError(f"need -n >= 1 and --nnodes >= 1, got -n {nproc} --nnodes {args.nnodes}")
    if args.grace_period is not None:
        raise ValueError("--grace-period applies to a parameter-server cluster (--workers N --ps P)")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise ValueError("--nnodes > 1 needs --rdzv-endpoint host:port (the first machine's address)")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0 (0: no restart), got {max_restarts}")
    if not args.monitor_interval > 0:
        raise ValueError(f"--monitor-interval must be > 0 seconds, got {args.monitor_interval}")
    if args.rdzv_endpoint:  # (before torch is imported: a mistake here is said at once)
        host, port = split_address(args.rdzv_endpoint, "--rdzv-endpoint")
    else:
        host, port = "127.0.0.1", find_free_port("127.0.0.1")
    from stratagem.comm.interfaces import (  # (imports torch: not for --ps)
        interface_of,
        route_source,
    )

    bind = args.bind
    if bind is None:
        bind = "127.0.0.1" if host in ("127.0.0.1", "localhost") else route_source(host, port)
    out = [
        f"--nproc-per-node={nproc}",
        f"--nnodes={args.nnodes}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={args.monitor_interval}",
        f"--local-addr={bind}",
    ]
    if args.node_rank is not None:
        out += ["--rdzv-backend=static", f"--node-rank={args.node_rank}",
                f"--master-addr={host}", f"--master-port={port}"]
    else:
        out += ["--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={args.rdzv_id}"]
    if args.module:
        out.append("-m")
    out += [args.script, *args.script_args]
    env: dict[str, str] = {}
    iface = interface_of(bind)
    if iface is None:
        raise ValueError(f"--bind {bind}: no network interface of this machine has that address")
    env["GLOO_SOCKET_IFNAME"] = iface
    if "OMP_NUM_THREADS" not in os.environ:
        # the replicas on this machine split its cores, as self-launched replicas do (and torch's
        # agent prints no banner about setting it to 1 for us)
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return out, env


def check_endpoint(host: str, port: int, timeout: float = 5.0) -> str:
    """"" when the rendezvous endpoint is free (this node will host it) or answers as a store;
    else what is wrong. torch's agent would wait forever on a process at the address that
    accepts connections and never answers (a stale job, another service on that port)."""
    try:
        socket.create_connection((host, port), timeout=2.0).close()
    except OSError:
        return ""  # nobody listens yet: the agent hosts it here, or waits for the host's
    from stratagem.comm import CollectiveError
    from stratagem.comm.communicator import connect_store

    try:
        connect_store(host, port, 1, is_master=False, timeout=timeout, rank=0)
    except CollectiveError as e:
        return f"--rdzv-endpoint {host}:{port}: {e}"
    return ""


def ps_job(args: argparse.Namespace) -> PSJob:
    """The parameter-server cluster ``--workers N --ps P`` asks for (not started yet)."""
    if args.nproc is not None:
        raise ValueError("-n/--nproc-per-node starts replicas of an all-reduce job; it cannot be "
                         "combined with --workers/--ps (a parameter-server cluster): use one or the other")
    if args.workers is None or args.ps is None:
        raise ValueError("a parameter-server cluster needs both --workers N and --ps P, got "
                         f"--workers {args.workers} --ps {args.ps}")
    if args.nnodes != 1 or args.node_rank is not None or args.rdzv_endpoint or args.bind:
        raise ValueError("--workers/--ps start every task on this machine; --nnodes, --node-rank, "
                         "--rdzv-endpoint and --bind do not apply (on many machines, set TF_CONFIG "
                         "on each task yourself)")
    if not args.module and not os.path.isfile(args.script):
        raise ValueError(f"no such script: {args.script!r} (for a module, add -m)")
    cmd = [sys.executable, *(["-m"] if args.module else []), args.script, *args.script_args]
    return PSJob(
        cmd, args.workers, args.ps,
        grace=30.0 if args.grace_period is None else args.grace_period,
        max_restarts=0 if args.max_restarts is None else args.max_restarts,
    )


def main(args: argparse.Namespace) -> int:
    """Run the job; the exit code is 0 when every replica succeeded (with --workers/--ps: the
    chief's exit code)."""
    if args.workers is not None or args.ps is not None:
        stop_guard.release()  # the parameter-server launcher stops its tasks itself
        try:
            job = ps_job(args)
        except ValueError as e:
            sys.stderr.write(f"stratagem run: {e}\n")
            return 2
        return job.run()
    try:
        if not args.module and not os.path.isfile(args.script):  # not N replicas' tracebacks
            raise ValueError(f"no such script: {args.script!r} (for a module, add -m)")
        targs, env = torchrun_args(args)
    except ValueError as e:
        sys.stderr.write(f"stratagem run: {e}\n")
        return 2
    if args.rdzv_endpoint and args.node_rank is None:
        problem = check_endpoint(*split_address(args.rdzv_endpoint, "--rdzv-endpoint"))
        if problem:
            sys.stderr.write(f"stratagem run: {problem}\n")
            return 2
    os.environ.update(env)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(_said_by_us)
    # torchrun's main copies the first failed replica's error file (a replica that ended because
    # another failed writes one) into this process's, and logs an error where it has none: give it
    # one (unless a launcher above gave this process its own)
    # torch's agent also makes a folder of its own for the replicas' error files (a new
    # /tmp/torchelastic_* on every run, never removed): both go in one folder of ours, removed at
    # the end, also when the stop guard ends the command
    # A launcher killed with SIGKILL cannot remove its folder: each launcher removes the ones whose
    # launcher is gone (its pid is in the name) before it makes its own
    sweep_scratch(tempfile.gettempdir())
    scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    stop_guard.at_end(lambda: shutil.rmtree(scratch, ignore_errors=True))
    targs.insert(0, f"--log-dir={os.path.join(scratch, 'agent')}")
    own_error_file = not os.environ.get("TORCHELASTIC_ERROR_FILE")
    if own_error_file:
        os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join(scratch, "error.json")
    # a Ctrl-C or SIGTERM that torch's agent swallows still ends the job (core/stop_guard,
    # installed when this command started)
    try:
        torchrun.main(targs)
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        sys.stderr.write(f"stratagem run: replica {rank} failed (exit code {failure.exitcode})\n")
        # the job failed: this process ends without Python's last full collection over torch's
        # heap (most of a second on a busy machine), as its replicas do
        gc.freeze()
        return 1
    finally:
        stop_guard.release()
        agent_log.removeFilter(_said_by_us)
        if own_error_file:
            del os.environ["TORCHELASTIC_ERROR_FILE"]
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


#: a launcher's scratch folder in the temporary directory: ``stratagem-run-<pid>-<random>``
SCRATCH_PREFIX = "stratagem-run-"
#: a folder this much older than now is a dead launcher's for sure (its replicas, which may write
#: their error files there, end within seconds of their launcher)
_SCRATCH_GRACE_S = 60.0


def sweep_scratch(tmp: str, now: float | None = None) -> list[str]:
    """Remove the scratch folders of launchers that are gone (SIGKILLed: nothing of theirs ran at
    exit): this user's ``stratagem-run-<pid>-*`` whose pid is not alive and whose folder is older
    than a minute. Returns the paths removed. A folder of a live launcher, of another user, or
    without a pid in its name is left alone."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(SCRATCH_PREFIX):
            continue
        pid_text = name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < _SCRATCH_GRACE_S or pid_alive(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class _SaidByUs(logging.Filter):
    """The agent's notes that one worker failed ("failed (exitcode: 1) local_rank: ...") and that
    it stops the others ("Sending process N closing signal SIGTERM"): each replica says why it
    ends, and ``main`` prints the one line naming the replica that failed first."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("failed (exitcode:", "Sending process"))


_said_by_us = _SaidByUs()


def _standalone(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stratagem")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return main(parser.parse_args(["run", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(_standalone())
