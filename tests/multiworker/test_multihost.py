"""Two "hosts" as Linux network namespaces joined by a veth pair (10.200.x.1 and 10.200.x.2):
MultiWorkerMirroredStrategy across them through `stratagem run --nnodes 2`. Needs root and `ip`;
skipped otherwise. Traffic stays between our own namespaces; they are always removed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and the `ip` command (iproute2)")
    tag = f"{os.getpid() % 100000}"
    ns = [f"sg{tag}h0", f"sg{tag}h1"]
    veth = [f"sg{tag}a", f"sg{tag}b"]
    subnet = 200 + os.getpid() % 50
    addrs = [f"10.{subnet}.0.1", f"10.{subnet}.0.2"]
    try:
        try:
            for n in ns:
                _ip("netns", "add", n)
            _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
        for n, v, a in zip(ns, veth, addrs):
            _ip("link", "set", v, "netns", n)
            _ip("netns", "exec", n, "ip", "addr", "add", f"{a}/24", "dev", v)
            _ip("netns", "exec", n, "ip", "link", "set", v, "up")
            _ip("netns", "exec", n, "ip", "link", "set", "lo", "up")
        yield ns, addrs
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", veth[0]], capture_output=True, timeout=20)


@pytest.mark.slow  # `--bind` across namespaces (tests/net has TF_CONFIG across hosts in the main tier), in the slow tier (CI runs it): the main tier under 15 minutes
@pytest.mark.timeout(150)
def test_multi_worker_mirrored_across_two_namespaces(two_hosts):
    ns, addrs = two_hosts
    port = 29400 + os.getpid() % 1000
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG"):
        env.pop(k, None)
    procs = []
    for i, n in enumerate(ns):
        cmd = ["ip", "netns", "exec", n, sys.executable, "-m", "stratagem.cli.run", "-n", "1",
               "--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint", f"{addrs[0]}:{port}",
               "--bind", addrs[i], str(HERE / "mw_script.py")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True, cwd=REPO))
    deadline = time.monotonic() + 120
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    report = "\n=====\n".join(o[-3000:] for o in outs)
    assert [p.returncode for p in procs] == [0, 0], report
    found = [re.search(r"rank=(\d) world=2 worker=(\d) digest=([0-9a-f]{16})", o) for o in outs]
    assert all(found), report
    assert [(m.group(1), m.group(2)) for m in found] == [("0", "0"), ("1", "1")]  # type: ignore[union-attr]
    assert found[0].group(3) == found[1].group(3)  # type: ignore[union-attr]
