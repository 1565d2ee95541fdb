"""Membership of a dynamic torch.distributed.rpc group: join it, take a dead member out of it, and
keep this process's own rpc calls off a change of its members.

A parameter-server cluster is a *dynamic* rpc group (``init_rpc`` without ``world_size``), so a
worker can leave and a restarted one come back. torch lets a live member leave (``shutdown``
takes the group's token, tells every other member, and removes its name from the group's list in
the store); a member that died cannot say goodbye, and while it is listed nobody can join (the
joiner calls every listed member) and its name cannot be taken again. :func:`evict` does on the
dead member's behalf what its own leaving would have done: under the same token it removes the
name from the list and tells the live members (torch's ``_update_group_membership``, the function
a leaving member calls on the others). The returning process joins under a rank never used before
(:func:`join`), since the agents keep a connection per rank and a dead one stays broken.

A change of members is not safe against the agent's other threads: torch's
``TensorPipeAgent::updateGroupMembership`` erases a member from its tables (worker id and name to
info, name to address) with no lock at all, and adds one under a lock that ``getWorkerInfos`` does
not take, while every call made (its destination looked up by name or id) and every RRef message
served reads those tables. So the members change only while the cluster is quiet: the coordinator
starts no function and waits for those under way, nobody pings over rpc (the tasks watch the
chief through its TCPStore), and :data:`LOCK` keeps this process's own calls (the chief's reads
of the ps tasks, a worker's variable traffic) off the change, here and, through :func:`_forget`,
on every member told of an eviction.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

#: keys torch's TensorPipe agent uses in the group's store (torch/csrc/distributed/rpc/agent_utils.cpp
#: and torch/distributed/rpc/_utils.py); the rejoin tests in tests/ps fail if they change
TOKEN_KEY = "RpcGroupManagementToken"
NAMES_PREFIX = "names"
ALL_WORKERS_KEY = "_ALL_WORKER_INFOS"

#: held while this process's agent changes the group's members (:func:`evict`, :func:`_forget`,
#: the chief admitting a restarted worker) and by this process's rpc calls that could otherwise
#: run meanwhile (``with LOCK:`` around the call and its wait); reentrant
LOCK = threading.RLock()


def join(name: str, rank: int, init_method: str, timeout: float) -> None:
    """This process joins the dynamic group at ``init_method`` as ``name`` with ``rank``."""
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout, num_worker_threads=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own deprecation notes
        rpc.init_rpc(name, rank=rank, rpc_backend_options=opts)


@contextlib.contextmanager
def _token(store: Any, holder: str, timeout: float) -> Iterator[None]:
    """The group's membership token (as torch's ``_group_membership_management``), waited for at
    most ``timeout`` seconds."""
    mine = f"Token_for_{holder}_leave"
    deadline = time.monotonic() + timeout
    while True:
        got = store.compare_set(TOKEN_KEY, "", mine).decode()
        if got == mine:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"the rpc group's membership token is held by {got!r} for more than {timeout:g}s")
        time.sleep(0.05)
    try:
        yield
    finally:
        store.set(TOKEN_KEY, "")
        store.set(mine, "Done")


def members() -> dict[str, int]:
    """The group as this process's agent knows it: name -> rank."""
    import torch.distributed.rpc as rpc

    agent = rpc.api._get_current_rpc_agent()
    return {w.name: w.id for w in agent.get_worker_infos()}


def evict(name: str, tell: Sequence[str], timeout: float, gone: Callable[[str], bool] = lambda _: False) -> None:
    """Take the dead member ``name`` out of the group: out of the store's list and out of this
    process's and every ``tell`` member's agent (one that cannot be told is lost itself, and
    reported as such by whoever needs it). A member is waited for until it answers, ``timeout``
    runs out, or ``gone(member)`` says it is lost too (its host cut off with this one's: nobody
    waits the whole timeout for it while holding :data:`LOCK`). The caller has made the cluster
    quiet; this process's own calls wait (:data:`LOCK`)."""
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    with LOCK:
        agent: Any = rpc.api._get_current_rpc_agent()  # a TensorPipeAgent
        known = members()
        if name not in known:
            return
        dead = agent.get_worker_info(name)
        me = agent.get_worker_info().name
        with _token(agent.store, f"{me}-evicts-{name}", timeout):
            names = dist.PrefixStore(NAMES_PREFIX, agent.store)
            listed = names.get(ALL_WORKERS_KEY).decode()
            names.set(ALL_WORKERS_KEY, listed.replace(f"{dead.name}-{dead.id},", ""))
            futures = {
                other: rpc.rpc_async(other, _forget, args=(dead,), timeout=timeout)
                for other in tell
                if other not in (me, name) and other in known
            }
            deadline = time.monotonic() + timeout
            for other, fut in futures.items():  # one given up on ends at its own timeout, unread
                while not fut.done() and not gone(other) and time.monotonic() < deadline:
                    time.sleep(0.02)
                if fut.done():
                    with contextlib.suppress(Exception):
                        fut.wait()
            agent._update_group_membership(dead, [], {}, False)


def _forget(dead: Any) -> None:
    """(On a member, called by :func:`evict`.) ``dead`` out of this process's agent, once this
    process's own calls that hold :data:`LOCK` are done."""
    from torch.distributed.rpc import _utils as rpc_utils

    with LOCK:
        rpc_utils._update_group_membership(dead, [], {}, False)


def leave_together(store: Any, prefix: str, timeout: float, *, owner: bool = False, wait_for_calls: bool = True) -> None:
    """Leave the group with the other members that reach this too (their number is at
    ``{prefix}/count``, set by the one who decides the group is done): first every member's
    references to the others' objects are released (torch's RRef deletion, as its graceful
    shutdown does), then each marks itself leaving and waits for its own calls, then all shut
    down. So nobody closes a connection that another still reads: a clean exit, without torch's
    one-member-at-a-time graceful leave of a dynamic group. Bounded by ``timeout`` per phase;
    a member that does not come is not waited for longer. An ``owner`` (a parameter server, whose
    objects the others reference) does not wait for references a dead member held. Without
    ``wait_for_calls`` this process does not wait for its own calls under way (torch's wait is
    unbounded: a call to a member that is unreachable ends only at its own timeout)."""
    import torch.distributed.rpc as rpc

    def barrier(phase: str) -> None:
        deadline = time.monotonic() + timeout
        with contextlib.suppress(Exception):
            store.wait([f"{prefix}/count"], timedelta(seconds=timeout))
            count = int(store.get(f"{prefix}/count").decode())
            store.add(f"{prefix}/{phase}", 1)
            while int(store.add(f"{prefix}/{phase}", 0)) < count and time.monotonic() < deadline:
                time.sleep(0.01)

    if not owner:
        with contextlib.suppress(Exception):
            rpc.api._delete_all_user_and_unforked_owner_rrefs(timedelta(seconds=timeout))
    barrier("released")
    if wait_for_calls:
        with contextlib.suppress(Exception):
            rpc.api._get_current_rpc_agent().join()  # dynamic group: wait for own calls, mark leaving
    barrier("leaving")
    with contextlib.suppress(Exception):
        rpc.shutdown(graceful=False)
