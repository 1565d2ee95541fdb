"""The hosts harness (``stratagem.testing.hosts``): hosts with their own addresses, a link cut
silently, slowed, restored, a host that vanishes, and nothing left behind. Needs root and `ip`;
skipped otherwise (CI runs as root)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.testing import hosts as hosts_mod
from stratagem.testing.hosts import Hosts

pytestmark = pytest.mark.skipif(bool(hosts_mod.unavailable()), reason=hosts_mod.unavailable() or "-")

SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5000))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    while c.recv(1 << 16):
        pass
    c.close()
"""

CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5000), timeout=3)
start, sent = time.monotonic(), 0
while time.monotonic() - start < float(sys.argv[2]):
    c.sendall(b"x" * 65536)
    sent += 65536
print(sent * 8 / (time.monotonic() - start) / 1e6)
"""


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def _server(host):
    proc = host.popen([sys.executable, "-c", SERVER, host.address], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


def _mbits(client_host, server_host, seconds=1.0) -> float:
    r = client_host.run([sys.executable, "-c", CLIENT, server_host.address, str(seconds)],
                        capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return float(r.stdout)


@pytest.mark.timeout(120)
def test_hosts_reach_each_other_by_their_own_addresses_and_a_cut_is_silent():
    with Hosts(2) as hosts:
        a, b = hosts
        assert a.address != b.address and hosts.addresses == [a.address, b.address]
        _server(a)
        assert _mbits(b, a, 0.3) > 100  # a veth link: fast
        b.cut()
        start = time.monotonic()
        r = b.run([sys.executable, "-c", CLIENT, a.address, "0.3"], capture_output=True, text=True)
        took = time.monotonic() - start
        # silent: no reset comes back; the client's own 3 s timeout ends it, or the address
        # resolution's (about 3 s: "No route to host"), as on a real network
        assert r.returncode != 0 and _unanswered(r.stderr), r.stderr
        assert took >= 2.5, took
        b.restore()
        assert _mbits(b, a, 0.3) > 100


@pytest.mark.timeout(120)
def test_a_slowed_link_holds_its_rate_and_restore_lifts_it():
    with Hosts(2) as hosts:
        a, b = hosts
        _server(a)
        b.slow("20mbit")
        assert _mbits(b, a, 2.0) < 40  # 20 Mbit/s, plus what the send buffers took at once
        b.restore()
        assert _mbits(b, a, 0.3) > 100


@pytest.mark.timeout(120)
def test_a_vanished_host_has_no_process_left_and_cannot_be_reached():
    with Hosts(2) as hosts:
        a, b = hosts
        server = _server(a)
        sleeper = a.popen([sys.executable, "-c", "import time; print('asleep', flush=True); time.sleep(600)"],
                          stdout=subprocess.PIPE, text=True)
        assert sleeper.stdout is not None and sleeper.stdout.readline().strip() == "asleep"  # inside by now
        assert len(a.pids()) >= 2
        a.vanish()
        assert a.pids() == []
        assert server.poll() is not None and sleeper.poll() is not None
        r = b.run([sys.executable, "-c", CLIENT, a.address, "0.3"], capture_output=True, text=True)
        assert r.returncode != 0 and _unanswered(r.stderr), r.stderr


def _unanswered(stderr: str) -> bool:
    """The connection got no answer (its timeout, or no link-layer address), not a reset."""
    return ("timed out" in stderr or "No route to host" in stderr) and "refused" not in stderr


@pytest.mark.timeout(120)
def test_everything_made_is_removed_also_on_an_exception():
    with pytest.raises(RuntimeError, match="on purpose"), Hosts(3) as hosts:
        made = set(hosts.namespaces())
        assert made <= _namespaces() and len(made) == 4  # 3 hosts and the switch
        proc = hosts[1].popen([sys.executable, "-c", "import time; time.sleep(600)"])
        raise RuntimeError("on purpose")
    assert proc.poll() is not None  # killed
    assert not (made & _namespaces())  # every namespace (and so every link) is gone


@pytest.mark.timeout(120)
def test_namespaces_of_a_killed_owner_are_swept_by_the_next_hosts():
    code = ("import os, sys; sys.path[:0] = sys.argv[1:]\n"
            "from stratagem.testing.hosts import Hosts\n"
            "h = Hosts(2); print(' '.join(h.namespaces()), flush=True); os._exit(0)")
    import stratagem

    src = str(Path(stratagem.__file__).parent.parent)
    r = subprocess.run([sys.executable, "-c", code, src], capture_output=True, text=True, timeout=60)
    left = set(r.stdout.split())
    assert len(left) == 3 and left <= _namespaces(), r.stderr  # the owner died without cleaning up
    with Hosts(1) as hosts:  # the next one sweeps them
        assert not (left & _namespaces())
        assert set(hosts.namespaces()) <= _namespaces()


def test_unavailable_names_the_reason():
    assert hosts_mod.unavailable() == ""  # (this module runs only where hosts can be made)
    with pytest.raises(ValueError, match="n >= 1"):
        Hosts(0)
