"""Every wait is bounded: a rendezvous address held by a process that accepts connections and
never answers is an error naming the address, the rank and the phase, within the timeout."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from stratagem.cluster.resolvers import SimpleClusterResolver
from stratagem.comm import CollectiveError
from stratagem.distribute.bootstrap import CommunicationOptions, connect_to_cluster


@pytest.fixture
def silent_listener():
    """A port whose process accepts every connection and never says a word."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


@pytest.mark.timeout(60)
def test_a_listener_that_never_answers_is_an_error_not_a_hang(silent_listener):
    port = silent_listener
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=rf"rank 1 reached 127.0.0.1:{port}, but nothing there answered as a rendezvous store within 2s \(phase: store handshake\)"):
        connect_to_cluster(SimpleClusterResolver(f"127.0.0.1:{port}", 2, 1), CommunicationOptions(timeout_seconds=2))
    assert time.monotonic() - start < 20  # promise: the 2 s timeout holds (then torch's client's retries are shut), never a hang
    # the connection was shut and the helper thread ended: nothing is left waiting
    assert not [t for t in threading.enumerate() if t.name == "stratagem-store-connect"]


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_stratagem_run_refuses_a_rendezvous_endpoint_that_never_answers(silent_listener, tmp_path, capsys):
    from stratagem.cli.run import _standalone

    script = tmp_path / "train.py"
    script.write_text("print('never started')\n")
    start = time.monotonic()
    code = _standalone(["-n", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{silent_listener}", str(script)])
    assert code == 2
    assert time.monotonic() - start < 20  # promise: the rendezvous timeout holds, never a hang
    err = capsys.readouterr().err
    assert f"--rdzv-endpoint 127.0.0.1:{silent_listener}: rank 0 reached" in err and "phase: store handshake" in err, err


@pytest.mark.timeout(60)
def test_a_worker_that_never_comes_is_named_within_the_timeout():
    """Rank 1 of 2 is never started: rank 0 names it after the timeout (2 s here), rather than
    torch's rendezvous key and a chained traceback."""
    from stratagem.cluster.launch import find_free_port

    port = find_free_port("127.0.0.1")
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=rf"rank 0 of 2: rank 1 never joined the job at 127.0.0.1:{port} within 2s \(not started") as info:
        connect_to_cluster(SimpleClusterResolver(f"127.0.0.1:{port}", 2, 0), CommunicationOptions(timeout_seconds=2))
    assert time.monotonic() - start < 10  # promise: named within the timeout (plus the store's start)
    assert info.value.__cause__ is None  # one error of ours, not torch's chained under it
