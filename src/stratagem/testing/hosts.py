"""Hosts of their own on one Linux machine, for testing what real networks do to a job.

Loopback hides network failures: a process that dies on the same host closes its sockets at once,
and nothing is ever slow or unreachable. ``Hosts(n)`` makes ``n`` hosts as network namespaces,
each with its own address on its own link (a veth pair) to one switch (a bridge in a namespace
of its own), and runs processes inside them. A link can then be cut silently (the switch's port
goes down: no RST, no FIN, packets vanish), slowed (a token-bucket ``tc ... tbf`` rate limit
both ways), restored, or a whole host made to vanish (every process in it SIGKILLed and its
link cut)::

    from stratagem.testing.hosts import Hosts

    with Hosts(2) as hosts:
        a, b = hosts
        server = a.popen([sys.executable, "server.py", "--bind", a.address])
        client = b.popen([sys.executable, "client.py", a.address])
        b.cut()        # b can no longer reach anyone, and nobody can reach b
        b.restore()

Needs Linux, root and iproute2's ``ip`` (``tc`` for ``slow``): :func:`unavailable` says why not,
for a test to skip with. The addresses (``10.77.0.1`` ...) exist only inside the namespaces it
makes, so nothing outside is reached or disturbed. Every namespace, link and process it made is
removed when the ``with`` block ends, also when it ends on an exception; namespaces left by a
process that was killed before it could clean up (a test's hard timeout) are removed by the next
``Hosts`` on the machine. The hosts share this machine's hostname (as two machines of a cluster
may), so a host's name does not tell them apart: their addresses do.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from stratagem.core.procs import pid_alive

PREFIX = "sgt"  # every namespace this module makes is called sgt<pid>n<k>-<role>
_counter = itertools.count()


#: the variables that place a process in a job (a rank, a cluster, a pinned interface)
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TF_CONFIG", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID")


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment for a process started on a host as a user would start it: none
    of the job variables it may have inherited (:data:`JOB_VARIABLES`), except those in
    ``extra``, which is added."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    env.update(extra)
    return env


def unavailable() -> str:
    """Why hosts cannot be made here ("" when they can)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need the `ip` command (iproute2)"
    return ""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise HostsError(f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.returncode}")
    return r


class HostsError(RuntimeError):
    """The hosts could not be made or changed (the ``ip``/``tc`` command's error inside)."""


def _namespace_pids(ns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in ``ns`` until none is left (a fork in flight is caught next round)."""
    for _ in range(50):
        pids = _namespace_pids(ns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _remove_namespace(ns: str) -> None:
    _kill_namespace(ns)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


#: ``ip netns exec NS`` bind-mounts the files of /etc/netns/NS over /etc's
NETNS_ETC = Path("/etc/netns")


def _no_dns(ns: str) -> None:
    """The host looks names up in /etc/hosts only (its own nsswitch.conf and an empty
    resolv.conf): this machine's name server cannot be reached from inside, and a reverse
    lookup (torch's store names its peers) would wait for it and then warn on stderr. Names
    resolve as on the machine otherwise."""
    d = NETNS_ETC / ns
    d.mkdir(parents=True, exist_ok=True)
    (d / "resolv.conf").write_text("# stratagem.testing.hosts: no name server inside these hosts\n")
    try:
        lines = Path("/etc/nsswitch.conf").read_text().splitlines()
    except OSError:
        lines = []
    kept = [line for line in lines if not line.split(":", 1)[0].strip() == "hosts"]
    (d / "nsswitch.conf").write_text("\n".join([*kept, "hosts: files"]) + "\n")


def sweep_stale() -> list[str]:
    """Remove the namespaces (and their processes) of ``Hosts`` whose process is gone; returns
    their names."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    removed = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX):].split("n", 1)[0]
        if owner.isdigit() and not pid_alive(int(owner)):
            _remove_namespace(name)
            removed.append(name)
    return removed


class Host:
    """One host: a network namespace with the address ``address`` on its interface ``eth0``,
    linked to the switch's port ``port``."""

    def __init__(self, hosts: Hosts, index: int, namespace: str, address: str) -> None:
        self.hosts = hosts
        self.index = index
        self.namespace = namespace
        self.address = address
        self.interface = "eth0"
        self.port = f"p{index}"  # its end of the link, on the switch
        self.processes: list[subprocess.Popen[Any]] = []
        self.slowed = False

    def __repr__(self) -> str:
        return f"Host({self.index}, {self.address}, namespace={self.namespace!r})"

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` as a command line that runs inside this host."""
        return ["ip", "netns", "exec", self.namespace, *args]

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``args`` inside this host (``subprocess.Popen``'s keywords; in a session of its
        own unless ``start_new_session=False``). It is SIGKILLed when the hosts are removed."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(args), **kwargs)
        self.processes.append(proc)
        return proc

    def run(self, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``args`` inside this host to the end (``subprocess.run``'s keywords)."""
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(args), **kwargs)

    def pids(self) -> list[int]:
        """Every process running inside this host."""
        return _namespace_pids(self.namespace)

    def cut(self) -> None:
        """Cut this host's link silently: its port on the switch goes down, so packets to and
        from it vanish without a reset, as when a cable is pulled or a switch fails. The host
        itself still sees its interface up (a carrier loss on a switch port is not signalled
        to it here). Nothing answers: a connection in place waits out its own timeouts; a new
        one finds no link-layer address for the peer and fails after about 3 s with "No route
        to host" (EHOSTUNREACH), as on a real network, never at once with a reset."""
        _ip("link", "set", self.port, "down", ns=self.hosts.switch)

    def restore(self) -> None:
        """Undo :meth:`cut` and :meth:`slow`. Every host forgets the link-layer addresses it
        failed to resolve meanwhile (the kernel would answer "No route to host" for a few
        seconds more, as a real network does until its neighbour entries expire)."""
        _ip("link", "set", self.port, "up", ns=self.hosts.switch)
        for h in self.hosts:
            _ip("neigh", "flush", "all", ns=h.namespace, check=False)
        if self.slowed:
            for ns, dev in ((self.namespace, self.interface), (self.hosts.switch, self.port)):
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                               capture_output=True, timeout=30)
            self.slowed = False

    def slow(self, rate: str = "20mbit", burst: str = "32kbit", latency: str = "400ms") -> None:
        """Hold this host's link to ``rate`` both ways (``tc``'s token-bucket filter; packets over
        the bucket wait up to ``latency``, then are dropped and resent by TCP)."""
        if shutil.which("tc") is None:
            raise HostsError("slow() needs the `tc` command (iproute2)")
        for ns, dev in ((self.namespace, self.interface), (self.hosts.switch, self.port)):
            r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                                "tbf", "rate", rate, "burst", burst, "latency", latency],
                               capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise HostsError(f"tc tbf on {ns}/{dev} failed: {r.stderr.strip()}")
        self.slowed = True

    def vanish(self) -> None:
        """The host disappears: its link is cut first (so nothing it does reaches anyone: no
        reset, no FIN from its dying sockets), then every process in it is SIGKILLed."""
        self.cut()
        _kill_namespace(self.namespace)
        for p in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


class Hosts:
    """``n`` hosts, each a network namespace with its own address (``10.77.0.1`` ...), linked
    to one switch. Use it as a context manager (or call :meth:`close`)."""

    def __init__(self, n: int = 2, *, subnet: str = "10.77.0") -> None:
        if n < 1:
            raise ValueError(f"Hosts needs n >= 1, got {n}")
        why = unavailable()
        if why:
            raise HostsError(why)
        self.n = n
        self.subnet = subnet
        self.tag = f"{PREFIX}{os.getpid()}n{next(_counter)}"
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self.closed = False
        sweep_stale()
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i in range(self.n):
            ns = f"{self.tag}-h{i}"
            _ip("netns", "add", ns)
            _no_dns(ns)
            host = Host(self, i, ns, f"{self.subnet}.{i + 1}")
            self.hosts.append(host)
            _ip("link", "add", host.interface, "netns", ns, "type", "veth",
                "peer", "name", host.port, "netns", self.switch)
            _ip("link", "set", host.port, "master", "br0", ns=self.switch)
            _ip("link", "set", host.port, "up", ns=self.switch)
            _ip("addr", "add", f"{host.address}/24", "dev", host.interface, ns=ns)
            _ip("link", "set", host.interface, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.hosts]

    def namespaces(self) -> list[str]:
        return [self.switch, *(h.namespace for h in self.hosts)]

    def close(self) -> None:
        """SIGKILL every process inside the hosts, then remove the namespaces (their links go
        with them). Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for h in self.hosts:
            _kill_namespace(h.namespace)
            for p in h.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
        for ns in reversed(self.namespaces()):
            _remove_namespace(ns)
