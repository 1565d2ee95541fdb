"""``stratagem run``: launch a script as N replicas on this machine, or as one node of many.

Built on torch's elastic agent (``torch.distributed.run``): this module only turns our options
into its argument list. One node: ``stratagem run -n 2 train.py``; two machines:
``stratagem run -n 2 --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 train.py`` on the
first and ``--node-rank 1`` on the second. Gloo is pinned to the interface that holds ``--bind``
(default: 127.0.0.1 on one node, else the address this machine reaches the endpoint from).
torch.distributed has no authentication: run it only on a network you trust.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import struct
import sys
from collections.abc import Sequence
from typing import Any

from stratagem.cluster.launch import find_free_port
from stratagem.cluster.resolvers import split_address

_SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 ``address`` (None if none does)."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def _route_source(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run",
        help="run a script on N replicas (processes), on this machine or as one node of many",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-n", "--nproc-per-node", "--replicas", dest="nproc", type=int, default=1,
                   help="replicas (processes) on this machine (default 1)")
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
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart every worker up to this many times after a failure (default 0); "
                        "reloading state is the script's job (CheckpointManager.restore_or_initialize)")
    p.add_argument("--monitor-interval", type=float, default=0.5,
                   help="seconds between the agent's checks of its workers")
    p.add_argument("-m", "--module", action="store_true", help="run a module (python -m) instead")
    p.add_argument("script", help="the script (or module with -m) to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p  # type: ignore[no-any-return]


def torchrun_args(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The ``torch.distributed.run`` argument list and the environment additions for ``args``."""
    if args.nproc < 1 or args.nnodes < 1:
        raise ValueError(f"need -n >= 1 and --nnodes >= 1, got -n {args.nproc} --nnodes {args.nnodes}")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise ValueError("--nnodes > 1 needs --rdzv-endpoint host:port (the first machine's address)")
    if args.rdzv_endpoint:
        host, port = split_address(args.rdzv_endpoint, "--rdzv-endpoint")
    else:
        host, port = "127.0.0.1", find_free_port("127.0.0.1")
    bind = args.bind
    if bind is None:
        bind = "127.0.0.1" if host in ("127.0.0.1", "localhost") else _route_source(host, port)
    out = [
        f"--nproc-per-node={args.nproc}",
        f"--nnodes={args.nnodes}",
        f"--max-restarts={args.max_restarts}",
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


def main(args: argparse.Namespace) -> int:
    """Run the job; the exit code is 0 when every replica succeeded."""
    try:
        targs, env = torchrun_args(args)
    except ValueError as e:
        print(f"stratagem run: {e}", file=sys.stderr)
        return 2
    if args.rdzv_endpoint and args.node_rank is None:
        problem = check_endpoint(*split_address(args.rdzv_endpoint, "--rdzv-endpoint"))
        if problem:
            print(f"stratagem run: {problem}", file=sys.stderr)
            return 2
    os.environ.update(env)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.main(targs)
    except ChildFailedError:
        return 1  # torch's agent has printed which rank failed, its exit code and error
    return 0


def _standalone(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stratagem")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return main(parser.parse_args(["run", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(_standalone())
