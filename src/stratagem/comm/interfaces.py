"""Which network interface a process of a multi-machine job talks on.

gloo (and NCCL's bootstrap) advertise to their peers the address this machine's hostname
resolves to unless told an interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``). On a stock
Debian/Ubuntu machine the hostname resolves to ``127.0.1.1``, so the peers are told to connect to
their own loopback and the job never forms (``Connection refused, remote=[127.0.0.1]``). The
cluster's addresses are known (TF_CONFIG, the rendezvous endpoint, Slurm's node list), so the
interface is too: the one that holds this task's own address when the cluster names it, else the
one this machine reaches the rendezvous from. :func:`pin` sets the variables a user did not set.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

logger = logging.getLogger("stratagem")


class InterfaceError(ValueError):
    """The cluster names an address for this task that no interface of this machine holds."""


def addresses() -> dict[str, list[str]]:
    """Every IPv4 address of every interface of this machine (name -> addresses): all of them
    with psutil, else (a machine without it) each interface's primary address."""
    out: dict[str, list[str]] = {}
    try:
        import psutil
    except ImportError:
        return _primary_addresses()
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        if v4:
            out[name] = v4
    return out


def _primary_addresses() -> dict[str, list[str]]:
    import fcntl
    import struct

    out: dict[str, list[str]] = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        out[name] = [socket.inet_ntoa(packed[20:24])]
    return out


def interface_of(address: str) -> str | None:
    """The interface that holds IPv4 ``address`` (None if none does)."""
    for name, addrs in addresses().items():
        if address in addrs:
            return name
    return None


def route_source(host: str, port: int = 9) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def _ipv4(host: str) -> str | None:
    """``host`` as an IPv4 address (resolved when it is a name; None if it does not resolve)."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def host_part(entry: str) -> str | None:
    """The host of a cluster entry (``host:port``, ``host``, ``[v6]:port``); None if empty."""
    host, sep, port = entry.rpartition(":")
    if sep and port.isdigit():
        entry = host
    return entry.strip("[]") or None


def is_loopback(host: str) -> bool:
    ip = _ipv4(host)
    return ip is not None and ipaddress.IPv4Address(ip).is_loopback


def choose(own_host: str | None, master_host: str, master_port: int) -> tuple[str, str, str]:
    """(interface, address, why) this process should talk on: the interface holding
    ``own_host`` (this task's address as the cluster names it) when one does, else the one
    this machine reaches ``master_host`` from. Raises InterfaceError when ``own_host`` is an
    address literal no interface holds (the cluster description names another machine)."""
    if own_host:
        ip = _ipv4(own_host)
        literal = ip == own_host
        if ip is not None and not ipaddress.IPv4Address(ip).is_loopback:
            name = interface_of(ip)
            if name is not None:
                return name, ip, f"it holds this task's address {own_host}"
            if literal:
                held = ", ".join(f"{n} {'/'.join(a)}" for n, a in sorted(addresses().items()))
                raise InterfaceError(
                    f"the cluster names {own_host} as this task's address, but no network interface "
                    f"of this machine has it (it has: {held}); fix this task's entry in the cluster "
                    "description (TF_CONFIG's cluster and task index), or set GLOO_SOCKET_IFNAME"
                )
    source = route_source(master_host, master_port)
    name = interface_of(source)
    if name is None:
        raise InterfaceError(
            f"this machine reaches the rendezvous {master_host}:{master_port} from {source}, "
            "but no interface holds that address; set GLOO_SOCKET_IFNAME"
        )
    return name, source, f"this machine reaches the rendezvous {master_host} through it"


#: the variables each transport reads its interface from
GLOO = "GLOO_SOCKET_IFNAME"
NCCL = "NCCL_SOCKET_IFNAME"
TENSORPIPE = "TP_SOCKET_IFNAME"  # torch.distributed.rpc's TensorPipe agent


def pin(own_host: str | None, master_host: str, master_port: int, *, rank: int,
        variables: tuple[str, ...] = (GLOO,)) -> str | None:
    """Set ``variables`` (``GLOO_SOCKET_IFNAME``; ``NCCL_SOCKET_IFNAME`` for GPUs,
    ``TP_SOCKET_IFNAME`` for rpc) to the interface :func:`choose` picks, unless the user set
    them or the rendezvous is on this machine's loopback (one machine: nothing to pick).
    Returns the interface set, or None."""
    if is_loopback(master_host):
        return None
    unset = [n for n in variables if not os.environ.get(n)]
    if not unset:
        return None
    name, address, why = choose(own_host, master_host, master_port)
    for n in unset:
        os.environ[n] = name
    if rank == 0:
        logger.debug("talking on interface %s (%s; %s), set as %s", name, address, why, ", ".join(unset))
    return name
