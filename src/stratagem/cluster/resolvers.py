"""Cluster resolvers: read TF_CONFIG, torchrun, Slurm (or arguments) once into a frozen ClusterSpec.

A *worker* is one machine (a torchrun node, a Slurm node, a TF_CONFIG task); it runs
``local_world_size`` processes, one replica each. The environment is read only here, when a
resolver is constructed; everything after works from the frozen :class:`ClusterSpec`.
``detect()`` picks the resolver that matches the environment (TF_CONFIG, then torchrun, then a
Slurm job step of more than one task, else a job of one process).
"""

from __future__ import annotations

import abc
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import final

from stratagem.cluster.ps_spec import PS_TASK_TYPES, PSClusterSpec
from stratagem.cluster.spec import LAUNCH_VARS, ClusterSpec

#: the port the chief's store listens on when a Slurm job does not say (MASTER_PORT unset).
SLURM_BASE_PORT = 15000


__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "PSClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFClusterSpec",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "detect",
    "expand_hostlist",
    "split_address",
]


def split_address(address: str, what: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``[::1]:port``) into host and port, or a ValueError saying why."""
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", address.strip())
    if m is None:
        raise ValueError(f"{what}: expected 'host:port', got {address!r}")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 <= port < 65536:
        raise ValueError(f"{what}: port {port} in {address!r} is not in 0..65535")
    return host, port


class ClusterResolver(abc.ABC):
    """Where the workers of the job are; implementations read their source once, at __init__.

    ``task_type`` / ``task_id`` are TensorFlow's: the job this process is a task of and its
    index in that job. Each stratagem process is one task, so a resolver without TF_CONFIG
    reports ``("worker", rank)`` (as tf's ``SlurmClusterResolver`` does); TF_CONFIG's resolver
    reports its ``task`` as given. Both can be set, as in TensorFlow. Who is rank 0 (the
    rendezvous, ``cluster_spec().is_chief``) is stratagem's own mapping and does not change them.
    """

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The frozen facts this resolver read."""

    @property
    def task_type(self) -> str | None:
        return self.__dict__.get("_task_type", "worker")

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self.__dict__["_task_type"] = task_type

    @property
    def task_id(self) -> int | None:
        if "_task_id" in self.__dict__:
            return self.__dict__["_task_id"]  # type: ignore[no-any-return]
        return self.cluster_spec().rank

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self.__dict__["_task_id"] = task_id

    @property
    def num_workers(self) -> int:
        return self.cluster_spec().num_workers

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: object = None
    ) -> dict[str, int]:
        """The accelerators of this machine by type, as tf counts them: ``{"GPU": n}``, ``{}``
        on a machine without one. Every task of a stratagem job is assumed to have the same."""
        del task_type, task_id, config_proto
        import torch  # the cluster layer reads no device otherwise

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {"GPU": count} if count else {}

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The rendezvous address, ``host:port`` (TF_CONFIG's resolver: tf's session master)."""
        del task_type, task_id
        return f"{rpc_layer}://{self.cluster_spec().master}" if rpc_layer else self.cluster_spec().master

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cluster_spec().describe()})"


@dataclass(frozen=True)
class TFClusterSpec(ClusterSpec):
    """What ``TFConfigClusterResolver.cluster_spec()`` returns: stratagem's ``ClusterSpec`` (this
    process's rank among all, chief first: what MultiWorkerMirroredStrategy joins with) that also
    answers as ``tf.train.ClusterSpec`` does about TF_CONFIG's ``cluster``: ``as_dict()``,
    ``jobs``, ``num_tasks``, ``task_indices``, ``task_address``, ``job_tasks``."""

    tf_jobs: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def _job(self, job_name: str) -> tuple[str, ...]:
        for name, tasks in self.tf_jobs:
            if name == job_name:
                return tasks
        raise ValueError(f"No such job in cluster: {job_name!r}")

    def as_dict(self) -> dict[str, list[str]]:
        return {name: list(tasks) for name, tasks in self.tf_jobs}

    @property
    def jobs(self) -> list[str]:
        return [name for name, _ in self.tf_jobs]

    def num_tasks(self, job_name: str) -> int:
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        return list(range(len(self._job(job_name))))

    def task_address(self, job_name: str, task_index: int) -> str:
        tasks = self._job(job_name)
        if not 0 <= task_index < len(tasks):
            raise ValueError(f"No task with index {task_index!r} in job {job_name!r}")
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list[str]:
        return list(self._job(job_name))

    def view(self) -> dict[str, object]:
        """TF_CONFIG's ``cluster`` as this process read it (every task must be given the same)."""
        return {"cluster": {name: list(tasks) for name, tasks in self.tf_jobs}, "rendezvous": self.master}

    def summary(self) -> str:
        jobs = ", ".join(f"{len(tasks)} {name}{'' if len(tasks) == 1 else 's'}" for name, tasks in self.tf_jobs)
        return f"a cluster of {jobs} (rendezvous {self.master})"

    @property
    def task_name(self) -> str:
        """This process's TF_CONFIG task, ``worker:1`` (``chief:0`` for a chief)."""
        chiefs = len(dict(self.tf_jobs).get("chief", ()))
        return "chief:0" if self.rank < chiefs else f"worker:{self.rank - chiefs}"


def _local_position(hosts: list[str], index: int) -> tuple[int, int]:
    host = hosts[index]
    same = [i for i, h in enumerate(hosts) if h == host]
    return same.index(index), len(same)


@final
class TFConfigClusterResolver(ClusterResolver):
    """The ``TF_CONFIG`` JSON: ``{"cluster": {"worker": [...]}, "task": {"type", "index"}}``.

    One process per task. ``task_type`` / ``task_id`` are TF_CONFIG's ``task`` as given, as in
    TensorFlow (``("worker", 0)`` for worker 0 whether or not the cluster has a chief), and
    ``master()`` is tf's: ``session_master`` if TF_CONFIG has one, ``""`` for a cluster of one
    task, else this task's address (``rpc_layer://`` before it when TF_CONFIG names one).
    stratagem's own order of the processes is separate: a ``"chief"`` job, if present, comes
    first (rank 0), otherwise worker 0 is rank 0, and rank 0's ``host:port`` is the rendezvous
    store (``cluster_spec().rank``, ``cluster_spec().master``). ``cluster_spec()`` is that
    :class:`ClusterSpec` and also answers as ``tf.train.ClusterSpec`` (``as_dict()``, ...).

    A cluster with a ``"ps"`` job is a parameter-server cluster (tf's rules: one chief, at least
    one worker and one ps task): :meth:`ps_cluster` describes it and :meth:`cluster_spec`
    (MultiWorkerMirroredStrategy's view) refuses it. The task's restart count is
    ``STRATAGEM_RESTART_COUNT`` (``stratagem run --workers N --ps P`` sets it), default 0. The
    environment is read once, when the resolver is made (tf re-reads TF_CONFIG at every call).
    """

    def __init__(self, environ: Mapping[str, str] | None = None, *, tf_config: str | None = None) -> None:
        env = os.environ if environ is None else environ
        text = tf_config if tf_config is not None else env.get("TF_CONFIG")
        if not text:
            raise ValueError("TF_CONFIG is not set; set it or pick another cluster resolver")
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {text[:200]!r}") from e
        cluster = config.get("cluster") if isinstance(config, dict) else None
        task = config.get("task") if isinstance(config, dict) else None
        if not isinstance(cluster, dict) or not isinstance(task, dict):
            raise ValueError(
                "TF_CONFIG must be {\"cluster\": {\"worker\": [\"host:port\", ...]}, "
                f"\"task\": {{\"type\": \"worker\", \"index\": i}}}}; got {text[:200]!r}"
            )
        self._spec: ClusterSpec | None = None
        self._ps: PSClusterSpec | None = None
        self._jobs: dict[str, list[str]] = {k: list(v) for k, v in cluster.items() if isinstance(v, list)}
        self._session_master = config.get("session_master")
        self._rpc_layer: str | None = config.get("rpc_layer")
        if "ps" in cluster:
            self._ps = _ps_cluster(cluster, task, _restart_count(env))
            self.task_type, self.task_id = self._ps.task_type, self._ps.task_id
            return
        unknown = set(cluster) - {"chief", "worker"}
        if unknown:
            raise ValueError(
                f"TF_CONFIG has jobs {sorted(unknown)}; MultiWorkerMirroredStrategy uses only "
                "'chief' and 'worker', ParameterServerStrategy 'chief', 'worker' and 'ps' "
                "(evaluators are not supported)"
            )
        chief = list(cluster.get("chief", []))
        workers = chief + list(cluster.get("worker", []))
        if len(chief) > 1:
            raise ValueError(f"TF_CONFIG lists {len(chief)} chiefs; at most one is allowed")
        if not workers:
            raise ValueError("TF_CONFIG lists no workers")
        ttype, tindex = task.get("type"), task.get("index", 0)
        if ttype not in ("chief", "worker") or not isinstance(tindex, int):
            raise ValueError(f"TF_CONFIG task {task!r}: type must be 'chief' or 'worker', index an int")
        index = tindex if ttype == "chief" else len(chief) + tindex
        if ttype == "chief" and tindex != 0 or not 0 <= index < len(workers):
            raise ValueError(f"TF_CONFIG task {task!r} is not in the cluster {cluster!r}")
        hosts = [split_address(w, f"TF_CONFIG worker {i}")[0] for i, w in enumerate(workers)]
        master_addr, master_port = split_address(workers[0], "TF_CONFIG chief")
        local_rank, local_world = _local_position(hosts, index)
        self._spec = TFClusterSpec(
            tuple(workers), index, index, len(workers), local_rank, local_world,
            master_addr, master_port, 0, "tf_config",
            tf_jobs=tuple((job, tuple(tasks)) for job, tasks in self._jobs.items()),
        )
        self.task_type, self.task_id = ttype, tindex

    def cluster_spec(self) -> ClusterSpec:
        if self._spec is None:
            assert self._ps is not None
            raise ValueError(
                f"TF_CONFIG describes a parameter-server cluster (chief, {self._ps.num_workers} "
                f"worker(s), {self._ps.num_ps} ps): MultiWorkerMirroredStrategy and the other "
                "all-reduce strategies cannot run on it; use ParameterServerStrategy (or drop "
                "the 'ps' job from TF_CONFIG)"
            )
        return self._spec

    def ps_cluster(self) -> PSClusterSpec:
        """The parameter-server cluster TF_CONFIG describes (it must have a ``ps`` job)."""
        if self._ps is None:
            raise ValueError(
                "TF_CONFIG has no 'ps' job: ParameterServerStrategy needs a cluster of a 'chief', "
                "'worker' tasks and 'ps' tasks, e.g. {\"cluster\": {\"chief\": [\"h0:2222\"], "
                "\"worker\": [\"h1:2222\"], \"ps\": [\"h2:2222\"]}, \"task\": {\"type\": "
                "\"worker\", \"index\": 0}}; for all-reduce training use MultiWorkerMirroredStrategy"
            )
        return self._ps

    @property
    def num_workers(self) -> int:
        """The workers: in a parameter-server cluster, the ``worker`` tasks (not the chief)."""
        return self._ps.num_workers if self._ps is not None else super().num_workers

    @property
    def rpc_layer(self) -> str | None:
        """TF_CONFIG's ``rpc_layer`` (None when it has none), as tf's resolver reports it."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """tf's session master: TF_CONFIG's ``session_master`` when set; ``""`` when the cluster
        has one job of one task; else the address of ``task_type:task_id`` (this task by
        default), as ``rpc_layer://host:port`` when an rpc layer is given or in TF_CONFIG.
        The rendezvous store stratagem meets at is ``cluster_spec().master`` (or
        ``ps_cluster().chief``)."""
        if self._session_master is not None:
            return str(self._session_master)
        if not self._jobs or (len(self._jobs) == 1 and len(next(iter(self._jobs.values()))) == 1):
            return ""
        ttype = task_type if task_type is not None else self.task_type
        tid = task_id if task_id is not None else self.task_id
        tasks = self._jobs.get(str(ttype))
        if tasks is None:
            raise ValueError(f"No such job in cluster: {ttype!r}")
        if tid is None or not 0 <= tid < len(tasks):
            raise ValueError(f"No task with index {tid!r} in job {ttype!r}")
        layer = rpc_layer if rpc_layer is not None else self.rpc_layer
        return f"{layer}://{tasks[tid]}" if layer else tasks[tid]

    def __repr__(self) -> str:
        if self._ps is not None:
            return f"TFConfigClusterResolver({self._ps.describe()})"
        return f"TFConfigClusterResolver(task {self.task_type}:{self.task_id}; {self.cluster_spec().describe()})"


def _restart_count(env: Mapping[str, str]) -> int:
    text = env.get("STRATAGEM_RESTART_COUNT", "0") or "0"
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"STRATAGEM_RESTART_COUNT must be a whole number >= 0, got {text!r}")
    return count


def _ps_cluster(cluster: dict[str, object], task: dict[str, object], restart_count: int) -> PSClusterSpec:
    """TF_CONFIG's parameter-server cluster, checked by tf's rules (one chief, >= 1 worker and ps)."""
    unknown = set(cluster) - set(PS_TASK_TYPES)
    if unknown:
        raise ValueError(
            f"TF_CONFIG has jobs {sorted(unknown)}; a parameter-server cluster has only 'chief', "
            "'worker' and 'ps' (evaluators are not supported)"
        )
    jobs: dict[str, list[str]] = {}
    for job in PS_TASK_TYPES:
        tasks = cluster.get(job, [])
        if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
            raise ValueError(f"TF_CONFIG job {job!r} must be a list of 'host:port' strings, got {tasks!r}")
        for i, address in enumerate(tasks):
            split_address(address, f"TF_CONFIG {job} {i}")
        jobs[job] = tasks
    counts = {job: len(tasks) for job, tasks in jobs.items()}
    if counts["chief"] != 1 or counts["worker"] < 1 or counts["ps"] < 1:
        raise ValueError(
            "TF_CONFIG has a 'ps' job (parameter servers): a parameter-server cluster needs exactly "
            "one 'chief' (the coordinator), at least one 'worker' and at least one 'ps' task; got "
            f"{counts['chief']} chief(s), {counts['worker']} worker(s), {counts['ps']} ps"
        )
    ttype, tindex = task.get("type"), task.get("index", 0)
    if ttype not in PS_TASK_TYPES or isinstance(tindex, bool) or not isinstance(tindex, int):
        raise ValueError(
            f"TF_CONFIG task {task!r}: type must be 'chief', 'worker' or 'ps', index an int"
        )
    if not 0 <= tindex < counts[ttype]:
        raise ValueError(
            f"TF_CONFIG task {task!r} is not in the cluster: it has {counts[ttype]} {ttype!r} task(s)"
        )
    return PSClusterSpec(
        jobs["chief"][0], tuple(jobs["worker"]), tuple(jobs["ps"]), ttype, tindex,
        "tf_config", restart_count,
    )


@final
class TorchrunClusterResolver(ClusterResolver):
    """The environment torchrun (and ``stratagem run``) gives each worker process."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        spec = ClusterSpec.from_environ(environ)
        if spec is None:
            raise ValueError(
                f"not started by torchrun: {list(LAUNCH_VARS)} are not set; start the script "
                "with `stratagem run -n N script.py` or pick another cluster resolver"
            )
        self._spec = spec

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list as host names, in the order ``scontrol show hostnames`` gives.

    ``node[01-03,7],gpu5`` is node01, node02, node03, node7, gpu5; a name with several bracket
    groups is their product, the leftmost varying slowest (``rack[1-2]-node[01-02]``: rack1-node01,
    rack1-node02, rack2-node01, rack2-node02). A range keeps its lower bound's zero padding.
    """
    from itertools import product

    hosts: list[str] = []
    for name in _split_top_level(text):
        # literal text and bracket groups, alternating: rack, 1-2, -node, 01-02, ''
        parts = re.split(r"\[([^\[\]]*)\]", name)
        literals, groups = parts[0::2], parts[1::2]
        if any("[" in lit or "]" in lit for lit in literals) or not all(g.strip() for g in groups):
            raise ValueError(f"bad Slurm host list {text!r}: unbalanced or empty brackets in {name!r}")
        choices = [[part] if i % 2 == 0 else _expand_group(part, name, text) for i, part in enumerate(parts)]
        hosts.extend("".join(combo) for combo in product(*choices))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """``a[1,2],b`` split at the commas outside brackets: ``['a[1,2]', 'b']``."""
    names: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise ValueError(f"bad Slurm host list {text!r}: brackets do not pair up at position {i}")
    if depth != 0:
        raise ValueError(f"bad Slurm host list {text!r}: a '[' is not closed")
    names.append(text[start:])
    return [n.strip() for n in names if n.strip()]


def _expand_group(group: str, name: str, text: str) -> list[str]:
    """One bracket group's alternatives: ``01-03,7`` is 01, 02, 03, 7."""
    out: list[str] = []
    for r in group.split(","):
        lo, dash, hi = r.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(
                f"bad Slurm host list {text!r}: {r!r} in {name!r} is not a number or a range "
                "such as 01-04"
            )
        if not dash:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"bad Slurm host list {text!r}: the range {r!r} in {name!r} runs backwards")
        out.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return out


@final
class SlurmClusterResolver(ClusterResolver):
    """A Slurm job step (``srun``): one process per task, the first node hosts the store.

    The port is ``MASTER_PORT`` when set, else ``SLURM_BASE_PORT`` + the job id mod 10000, so
    every task of one job computes the same port.
    """

    def __init__(self, environ: Mapping[str, str] | None = None, *, port: int | None = None) -> None:
        env = os.environ if environ is None else environ
        need = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST")
        missing = [k for k in need if k not in env and not (k == "SLURM_JOB_NODELIST" and "SLURM_NODELIST" in env)]
        if missing:
            raise ValueError(f"not a Slurm job step: {missing} not set; run the script with srun")
        try:
            rank = int(env["SLURM_PROCID"])
            world = int(env["SLURM_NTASKS"])
            local_rank = int(env.get("SLURM_LOCALID", "0"))
            node = int(env.get("SLURM_NODEID", "0"))
            job = int(env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", "0")))
            if port is None:
                port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else SLURM_BASE_PORT + job % 10000
        except ValueError as e:
            raise ValueError(f"malformed Slurm environment: {e}") from e
        nodes = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])
        if not nodes:
            raise ValueError("SLURM_JOB_NODELIST is empty")
        per_node = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_STEP_TASKS_PER_NODE") or ""
        m = re.match(r"(\d+)", per_node)
        local_world = int(m.group(1)) if m else max(1, world // len(nodes))
        master = env.get("MASTER_ADDR", nodes[0])
        self._spec = ClusterSpec(
            tuple(nodes), min(node, len(nodes) - 1), rank, world, local_rank, local_world,
            master, int(port), 0, "slurm", int(env.get("SLURM_RESTART_COUNT", "0") or 0),
        )

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


@final
class SimpleClusterResolver(ClusterResolver):
    """Given by hand: the chief's ``address`` (host:port), ``num_workers`` processes, this one's index.

    Reads no environment. ``local_rank``/``local_world_size`` describe processes sharing a machine.
    """

    def __init__(
        self,
        address: str,
        num_workers: int,
        task_index: int,
        *,
        local_rank: int = 0,
        local_world_size: int = 1,
    ) -> None:
        host, port = split_address(address, "SimpleClusterResolver address")
        if num_workers < 1 or not 0 <= task_index < num_workers:
            raise ValueError(
                f"SimpleClusterResolver: need num_workers >= 1 and 0 <= task_index < num_workers, "
                f"got num_workers={num_workers}, task_index={task_index}"
            )
        workers = tuple(address if i == 0 else "" for i in range(num_workers))
        self._spec = ClusterSpec(
            workers, task_index, task_index, num_workers, local_rank, local_world_size, host, port,
        )

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


def detect(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """The resolver the environment calls for: TF_CONFIG, torchrun, Slurm, else one process
    (whose ``task_type`` and ``task_id`` are None, as tf's resolver says without TF_CONFIG)."""
    env = os.environ if environ is None else environ
    if env.get("TF_CONFIG"):
        return TFConfigClusterResolver(env)
    if any(k in env for k in LAUNCH_VARS):
        return TorchrunClusterResolver(env)
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return SlurmClusterResolver(env)
    alone = SimpleClusterResolver("127.0.0.1:0", 1, 0)
    alone.task_type, alone.task_id = None, None  # tf's answer without TF_CONFIG
    return alone
