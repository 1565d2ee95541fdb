"""Worker processes forked from one that has already imported torch: the test harness's start-up.

Every multi-process test starts fresh Python processes, and each spends seconds of CPU importing
torch before it runs a line of the test (on a 2-core machine, most of a short test). A *zygote*
is one process per test session that imports torch and stratagem once and then, on request,
forks a child that becomes exactly what ``python -c CODE`` with that environment would be: its
own session (``setsid``, as ``start_new_session=True``), the given stdout and stderr, the
environment and working directory of the request, ``sys.argv == ["-c"]``, and CODE run at the
top level of ``__main__``, so the interpreter exits as usual (threads joined, ``atexit``,
finalizers, the exit code of an exception or ``sys.exit``).

Only what cannot differ after the import is forked: a request whose environment differs from the
zygote's in a variable not in :data:`LATE_VARIABLES` (one torch or a library may read while it
is imported: ``OMP_NUM_THREADS``, ``TORCH_LOGS``, ...) is started as a plain subprocess instead.
The zygote never touches a device, starts no process group and installs no signal handler, so a
child inherits nothing a fresh interpreter would not have.

Protocol, over a Unix socket pair: the harness sends a pickled request with the child's stdout
and stderr descriptors attached (``SCM_RIGHTS``); the zygote answers ``("pid", n)``, and later
``("exit", n, returncode)`` (negative for a signal, as :mod:`subprocess`) once it reaped the child.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

#: variables read after start-up (by stratagem, torch.distributed, the test harness), so a forked
#: child may have values the zygote did not
LATE_VARIABLES = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "STRATAGEM_LAUNCHER", "TORCHELASTIC_USE_AGENT_STORE",
    "STRATAGEM_TEST_TARGET", "STRATAGEM_TEST_ARGS", "STRATAGEM_TEST_RESULT", "PYTHONPATH",
    "PYTEST_CURRENT_TEST",  # pytest sets it anew for every test
})

#: what the zygote imports before it serves (what every worker of the harness imports first)
PRELOAD = ("torch", "torch.distributed", "stratagem", "stratagem.testing.workers")

#: what workers import later, at a cost each time (measured: an optimizer's first use imports
#: torch._dynamo, 2.2 s of a 3.6 s two-process test; a pipeline's materializer, DTensor and FSDP
#: 1 s more): imported once here where this torch has them. None of these touch a GPU.
WARM = (
    "torch._dynamo", "torch.optim", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp", "torch.distributed._shard", "torch.distributed.checkpoint",
    "torch.distributed.nn", "torch.distributed.rpc", "torch.distributed.pipelining",
    "torch.distributed.algorithms.join", "torch.utils.checkpoint", "torch.fx", "pytest",
)  # fmt: skip

_BOOT = (
    "from stratagem.testing import zygote as _z\n"
    "_code = _z.serve()\n"
    "del _z\n"
    "exec(compile(_code, '<string>', 'exec'))\n"
)


def _send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(obj)
    msg = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [msg], fds)
    else:
        sock.sendall(msg)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the zygote's peer is gone")
        buf += chunk
    return buf


def serve() -> str:
    """The zygote's loop (in the zygote process): import, then fork a child per request. Returns
    only in a child, with the code the child runs; the zygote itself exits when the harness is
    gone."""
    for name in PRELOAD:
        __import__(name)
    for name in WARM:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001, S112 - an older torch without it: the worker imports what it has
            continue
    import torch

    import stratagem

    stratagem._import_public()  # the package imports its names on first use: all of them, once

    if torch.cuda.is_initialized():  # a forked child could not use the GPU: serve nobody
        os._exit(3)  # (the harness then starts every worker afresh)
    sock = socket.socket(fileno=int(os.environ.pop("STRATAGEM_ZYGOTE_FD")))
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.02)
        if ready:
            try:
                head, fds, _, _ = socket.recv_fds(sock, 4, 2)
                if len(head) < 4 or len(fds) != 2:
                    raise EOFError
                request = pickle.loads(_recv_exact(sock, struct.unpack("!I", head)[0]))
            except (EOFError, OSError):
                os._exit(0)
            in_session, tell = os.pipe()
            pid = os.fork()
            if pid == 0:
                sock.close()
                os.close(in_session)
                return _become(request, fds, tell)
            os.close(tell)
            os.read(in_session, 1)  # EOF once the child is in its own session (as Popen returns after exec)
            os.close(in_session)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(sock, ("pid", pid))
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, ("exit", pid, os.waitstatus_to_exitcode(status)))


def _become(request: dict[str, Any], fds: list[int], tell: int) -> str:
    """In the forked child: this process becomes ``python -c code`` as the request describes."""
    os.setsid()
    os.close(tell)  # the zygote may now report this pid: a killpg reaches this session
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [os.path.abspath(p) for p in extra if os.path.abspath(p) not in sys.path]
    sys.argv[:] = ["-c"]
    return str(request["code"])


class ZygoteChild:
    """A child forked by the zygote, used as a :class:`subprocess.Popen` (pid, poll, wait)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, block=False)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, block=True, timeout=timeout)
        return self.returncode  # type: ignore[return-value]


class Zygote:
    """The harness's end: one zygote process, started with ``env``; children on request."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child_env = {**self.env, "STRATAGEM_ZYGOTE_FD": str(theirs.fileno())}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT], env=child_env, pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.exits: dict[int, int] = {}

    def accepts(self, env: Mapping[str, str]) -> bool:
        """Whether a child with ``env`` may be forked from this zygote (else: start it afresh)."""
        if self.proc.poll() is not None:
            return False
        keys = set(env) | set(self.env)
        return all(env.get(k) == self.env.get(k) for k in keys - LATE_VARIABLES)

    def start(self, code: str, env: Mapping[str, str], cwd: str | None, stdout: IO[Any], stderr: IO[Any]) -> ZygoteChild | None:
        """A child running ``code``; None if the zygote is gone (it refuses to serve when the
        import touched a GPU): the caller starts the process afresh."""
        request = {"code": code, "env": dict(env), "cwd": cwd or os.getcwd()}
        with self.lock:
            try:
                _send(self.sock, request, [stdout.fileno(), stderr.fileno()])
                while True:
                    msg = self._read(None)
                    if msg[0] == "pid":
                        return ZygoteChild(self, msg[1])
            except (EOFError, OSError):
                return None

    def _read(self, timeout: float | None) -> tuple[Any, ...]:
        """One message (pids are answered in order; exits are recorded as they come); waits at
        most ``timeout`` seconds for it to begin (a message is a few bytes, sent whole)."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            raise TimeoutError
        head = _recv_exact(self.sock, 4)
        msg = pickle.loads(_recv_exact(self.sock, struct.unpack("!I", head)[0]))
        if msg[0] == "exit":
            self.exits[msg[1]] = msg[2]
        return tuple(msg)

    def exit_code(self, pid: int, *, block: bool, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else _now() + timeout
        with self.lock:
            while pid not in self.exits:
                left = None if deadline is None else max(0.0, deadline - _now())
                try:
                    self._read(left if block else 0.0)
                except TimeoutError:
                    if not block:
                        return None
                    if deadline is not None and _now() >= deadline:
                        raise subprocess.TimeoutExpired(f"zygote child {pid}", timeout or 0) from None
                except (EOFError, OSError):
                    return self._lost(pid)
            return self.exits.pop(pid)

    def _lost(self, pid: int) -> int:
        """The zygote died: its children were re-parented and their status cannot be read; one
        that is gone counts as killed."""
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return -9
        raise RuntimeError(f"the test zygote died while its child {pid} still runs")

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _now() -> float:
    return time.monotonic()
