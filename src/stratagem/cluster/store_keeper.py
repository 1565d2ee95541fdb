"""A store keeper: the job's ``TCPStore`` in a process of its own that trains nothing.

Under ``FailureOptions(on_failure="continue")`` a self-launched job must survive the loss of any
replica, rank 0 too; a store inside rank 0 would end the job with it (issue 49, item 2). So the
launcher starts this keeper, which hosts torch's own ``TCPStore`` server (nothing of ours on the
wire) and lives exactly as long as the job: it reads its stdin, a pipe whose write end only the
launcher and the replicas hold (``pass_fds``), until every holder has ended (end of file), then
exits. Nothing else ends it: not the launcher's death (a SIGKILLed rank 0 is a lost replica like
any other), not a replica's. torch elastic's agent keeps its store the same way, outside its
workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

_MAIN = "from stratagem.cluster.store_keeper import _main; _main()"


@dataclass
class StoreKeeper:
    """A started keeper: its process and the write end of its pipe (give it to every replica)."""

    process: subprocess.Popen[bytes]
    fd: int

    def wait_listening(self, host: str, port: int, timeout: float) -> None:
        """Until the keeper's store accepts connections (a clear error if it died or did not)."""
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the job's store keeper (pid {self.process.pid}) ended with code "
                    f"{self.process.returncode} before it listened at {host}:{port}"
                )
            try:
                with socket.create_connection((host, port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.02)
        raise TimeoutError(f"the job's store keeper did not listen at {host}:{port} within {timeout:g}s")


def start_keeper(host: str, port: int, world_size: int) -> StoreKeeper:
    """Start a keeper hosting the job's store at ``host:port``; returns it. Every replica this
    process starts must get ``keeper.fd`` (``pass_fds``); this process holds it until it ends."""
    read, write = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _MAIN, host, str(port), str(world_size)],
            stdin=read, stdout=subprocess.DEVNULL, start_new_session=False,
        )  # fmt: skip
    finally:
        os.close(read)
    return StoreKeeper(process, write)


def _main() -> None:  # pragma: no cover - runs in the keeper process
    import datetime
    import signal

    import torch.distributed as dist

    # Ctrl-C reaches the whole foreground group: the replicas end by themselves, and may still
    # say so through the store; the keeper ends after them (end of file), not before
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    host, port, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    while sys.stdin.buffer.read(4096):  # nothing is written: end of file once every holder ended
        pass
    del store
