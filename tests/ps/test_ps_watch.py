"""How fast a ParameterServerStrategy task that falls silent is declared lost, and that the bound
is the user's to set (``ParameterServerStrategy(failure=FailureOptions(...))``).

A task on another host is watched by its heartbeat in the chief's store; here the "other host"
is a record in a real TCPStore naming a host identity that is not this one, whose beats stop
(what a host that vanished, or whose link was cut, leaves behind). The whole path, on hosts of
their own, is the fault matrix's `ps hosts` cases.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch.distributed as dist

from stratagem.cluster.launch import find_free_port
from stratagem.distribute.engines.ps_watch import PREFIX, ClusterWatch, Loss


def _remote_task(store, name: str) -> None:
    store.set(f"{PREFIX}/who/{name}", json.dumps({"pid": 1, "host": "another-host", "nonce": name}))
    store.add(f"{PREFIX}/beat/{name}", 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("silent_after", [1.0, 2.5])
def test_a_silent_task_on_another_host_is_lost_after_the_configured_silence_and_a_beating_one_is_not(silent_after):
    port = find_free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    _remote_task(store, "worker:0")  # its beats stop here
    _remote_task(store, "worker:1")  # beats on, slowly (a slow link is not a dead one)
    losses: list[tuple[float, Loss]] = []
    start = time.monotonic()
    watch = ClusterWatch("127.0.0.1", port, "chief", lambda: ["worker:0", "worker:1"],
                         lambda loss: losses.append((time.monotonic() - start, loss)),
                         nonce="chief", silent_after=silent_after, beat=0.05).start()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(silent_after / 3):
            store.add(f"{PREFIX}/beat/worker:1", 1)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        time.sleep(silent_after + 1.5)
    finally:
        stop.set()
        watch.close()
        beater.join()
    assert [loss.task for _, loss in losses] == ["worker:0"], losses
    took, loss = losses[0]
    assert f"it sent no heartbeat for {silent_after:g}s (its host is cut off or gone)" == loss.why
    # the promise: lost once silent for silent_after, and within a few beats of it
    assert silent_after <= took < silent_after + 1.0, took


@pytest.mark.timeout(60)
def test_once_closed_the_watch_asks_nothing_more_of_the_store():
    """close() returns when the watch's threads are out of the store: its server may go next (the
    chief's at its end); a call in flight then printed torch's warning with a C++ stack trace."""
    port = find_free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    inside = threading.Event()

    def watched() -> list[str]:  # a look at the tasks that takes a while (a busy machine)
        inside.set()
        time.sleep(0.5)
        return []

    watch = ClusterWatch("127.0.0.1", port, "chief", watched, print, nonce="chief", silent_after=2.0, beat=0.05).start()
    assert inside.wait(10)
    watch.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("stratagem-ps-")]
    del store


def test_the_bounds_are_checked():
    with pytest.raises(ValueError, match="need 0 < beat < silent_after, got 2.0 and 1.0"):
        ClusterWatch("127.0.0.1", 1, "chief", list, print, nonce="x", silent_after=1.0, beat=2.0)


@pytest.mark.timeout(60)
def test_a_strategy_that_would_not_watch_its_tasks_is_refused(monkeypatch):
    import stratagem as sg

    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    with pytest.raises(ValueError, match=r"FailureOptions\(enabled=False\) is not supported"):
        sg.ParameterServerStrategy(failure=sg.FailureOptions(enabled=False), timeout=2)
