"""The one-process fault matrix: cluster descriptions that cannot work (TF_CONFIG, the launch
variables torchrun and ``stratagem run`` set, Slurm's, a resolver given by hand), each refused
in the one process that reads it, and ``stratagem`` commands given bad arguments (run as a user
runs them: ``python -m stratagem ...``, a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from matrix_kit import Outcome, Registry

from stratagem.cluster.resolvers import (
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    detect,
    expand_hostlist,
)
from stratagem.cluster.spec import ClusterSpec

R = Registry()
err, ok = R.error, R.ok
REPO = Path(__file__).resolve().parents[2]


def _tf(config: object) -> TFConfigClusterResolver:
    text = config if isinstance(config, str) else json.dumps(config)
    return TFConfigClusterResolver({"TF_CONFIG": text})


W2 = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


# --- TF_CONFIG ---------------------------------------------------------------------------------------
@err("TF_CONFIG: not JSON", ValueError, "TF_CONFIG is not valid JSON", "{'cluster'")
def _(d: Path) -> object:
    return _tf("{'cluster': {}}")


@err("TF_CONFIG: set but empty", ValueError, "TF_CONFIG is not set")
def _(d: Path) -> object:
    return _tf("")


@err("TF_CONFIG: a list, not an object", ValueError, "TF_CONFIG must be", '"cluster"')
def _(d: Path) -> object:
    return _tf([1, 2])


@err("TF_CONFIG: no task", ValueError, "TF_CONFIG must be", '"task"')
def _(d: Path) -> object:
    return _tf({"cluster": W2})


@err("TF_CONFIG: task index out of range", ValueError, "'index': 2", "is not in the cluster")
def _(d: Path) -> object:
    return _tf({"cluster": W2, "task": {"type": "worker", "index": 2}})


@err("TF_CONFIG: negative task index", ValueError, "'index': -1", "is not in the cluster")
def _(d: Path) -> object:
    return _tf({"cluster": W2, "task": {"type": "worker", "index": -1}})


@err("TF_CONFIG: task index a string", ValueError, "'index': '1'", "index an int")
def _(d: Path) -> object:
    return _tf({"cluster": W2, "task": {"type": "worker", "index": "1"}})


@err("TF_CONFIG: unknown task type", ValueError, "'type': 'master'", "'chief' or 'worker'")
def _(d: Path) -> object:
    return _tf({"cluster": W2, "task": {"type": "master", "index": 0}})


@err("TF_CONFIG: an evaluator job", ValueError, "['evaluator']", "evaluators are not supported")
def _(d: Path) -> object:
    return _tf(
        {"cluster": {**W2, "evaluator": ["127.0.0.1:2224"]}, "task": {"type": "worker", "index": 0}}
    )


@err("TF_CONFIG: two chiefs", ValueError, "lists 2 chiefs")
def _(d: Path) -> object:
    return _tf({"cluster": {"chief": ["a:1", "b:2"], **W2}, "task": {"type": "worker", "index": 0}})


@err("TF_CONFIG: chief index 1", ValueError, "'type': 'chief'", "is not in the cluster")
def _(d: Path) -> object:
    return _tf(
        {"cluster": {"chief": ["127.0.0.1:2221"], **W2}, "task": {"type": "chief", "index": 1}}
    )


@err("TF_CONFIG: no workers", ValueError, "lists no workers")
def _(d: Path) -> object:
    return _tf({"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}})


@err(
    "TF_CONFIG: an address without a port",
    ValueError,
    "TF_CONFIG worker 1",
    "'host:port'",
    "'127.0.0.1'",
)
def _(d: Path) -> object:
    return _tf(
        {
            "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1"]},
            "task": {"type": "worker", "index": 0},
        }
    )


@err("TF_CONFIG: port 70000", ValueError, "port 70000", "0..65535")
def _(d: Path) -> object:
    return _tf({"cluster": {"worker": ["127.0.0.1:70000"]}, "task": {"type": "worker", "index": 0}})


@err("TF_CONFIG: a port that is not a number", ValueError, "'host:port'", "h:http")
def _(d: Path) -> object:
    return _tf({"cluster": {"worker": ["h:http"]}, "task": {"type": "worker", "index": 0}})


@err(
    "TF_CONFIG: a ps cluster under MultiWorkerMirroredStrategy",
    ValueError,
    "parameter-server cluster",
    "ParameterServerStrategy",
)
def _(d: Path) -> object:
    r = _tf(
        {
            "cluster": {"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]},
            "task": {"type": "worker", "index": 0},
        }
    )
    return r.cluster_spec()


@err("TF_CONFIG: ParameterServerStrategy's cluster without ps", ValueError, "has no 'ps' job")
def _(d: Path) -> object:
    return _tf({"cluster": W2, "task": {"type": "worker", "index": 0}}).ps_cluster()


@err("TF_CONFIG: a ps cluster without a chief", ValueError, "chief")
def _(d: Path) -> object:
    return _tf(
        {"cluster": {"worker": ["b:1"], "ps": ["c:1"]}, "task": {"type": "worker", "index": 0}}
    )


@err("TF_CONFIG: a ps task index out of range", ValueError, "ps", "3")
def _(d: Path) -> object:
    return _tf(
        {
            "cluster": {"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]},
            "task": {"type": "ps", "index": 3},
        }
    )


@err("TF_CONFIG: STRATAGEM_RESTART_COUNT=-1", ValueError, "STRATAGEM_RESTART_COUNT", "'-1'")
def _(d: Path) -> object:
    cfg = {
        "cluster": {"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]},
        "task": {"type": "worker", "index": 0},
    }
    return TFConfigClusterResolver({"TF_CONFIG": json.dumps(cfg), "STRATAGEM_RESTART_COUNT": "-1"})


@ok("TF_CONFIG: a chief and 2 workers", "ranks in TF's order")
def _(d: Path) -> str:
    cfg = {"cluster": {"chief": ["127.0.0.1:2221"], **W2}, "task": {"type": "worker", "index": 1}}
    spec = _tf(cfg).cluster_spec()
    if (spec.rank, spec.world_size, spec.master) != (2, 3, "127.0.0.1:2221"):
        raise Outcome("silent wrong", spec.describe())
    return spec.describe()


# --- the launch variables ----------------------------------------------------------------------------
LAUNCH = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@err("launch: RANK outside WORLD_SIZE", RuntimeError, "RANK=2 is outside WORLD_SIZE=2")
def _(d: Path) -> object:
    return ClusterSpec.from_environ({**LAUNCH, "RANK": "2"})


@err("launch: a negative RANK", RuntimeError, "RANK=-1 is outside WORLD_SIZE=2")
def _(d: Path) -> object:
    return ClusterSpec.from_environ({**LAUNCH, "RANK": "-1"})


@err(
    "launch: half the variables set",
    RuntimeError,
    "['RANK', 'WORLD_SIZE']",
    "MASTER_ADDR",
    "stratagem run",
)
def _(d: Path) -> object:
    return ClusterSpec.from_environ({"RANK": "0", "WORLD_SIZE": "2"})


@err("launch: RANK not a number", RuntimeError, "malformed launch environment", "'one'")
def _(d: Path) -> object:
    return ClusterSpec.from_environ({**LAUNCH, "RANK": "one"})


@err("launch: MASTER_PORT not a number", RuntimeError, "malformed launch environment", "'x'")
def _(d: Path) -> object:
    return ClusterSpec.from_environ({**LAUNCH, "MASTER_PORT": "x"})


@err("launch: WORLD_SIZE=0", RuntimeError, "WORLD_SIZE=0")
def _(d: Path) -> object:
    return ClusterSpec.from_environ({**LAUNCH, "WORLD_SIZE": "0"})


@err("launch: the torchrun resolver with half the variables", RuntimeError, "MASTER_PORT")
def _(d: Path) -> object:
    return TorchrunClusterResolver({"RANK": "1", "MASTER_ADDR": "h"})


@ok("launch: detect() with nothing set", "one process, task None")
def _(d: Path) -> str:
    r = detect({})
    spec = r.cluster_spec()
    if spec.world_size != 1 or r.task_type is not None:
        raise Outcome("silent wrong", f"{spec.describe()}, task {r.task_type}")
    return "detect({}): one process, task_type None (tf's answer without TF_CONFIG)"


@ok("launch: detect() under torchrun's variables", "rank and world from them")
def _(d: Path) -> str:
    spec = detect({**LAUNCH, "RANK": "1", "LOCAL_RANK": "1"}).cluster_spec()
    if (spec.rank, spec.world_size, spec.master) != (1, 2, "127.0.0.1:29500"):
        raise Outcome("silent wrong", spec.describe())
    return spec.describe()


# --- Slurm, by hand ----------------------------------------------------------------------------------
SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-2]"}


@err("slurm: outside a job step", ValueError, "not a Slurm job step", "SLURM_NTASKS", "srun")
def _(d: Path) -> object:
    return SlurmClusterResolver({"SLURM_PROCID": "0"})


@err(
    "slurm: a host list with an unclosed bracket",
    ValueError,
    "bad Slurm host list 'node[1-2'",
    "not closed",
)
def _(d: Path) -> object:
    return SlurmClusterResolver({**SLURM, "SLURM_JOB_NODELIST": "node[1-2"})


@err("slurm: a range that runs backwards", ValueError, "runs backwards")
def _(d: Path) -> object:
    return expand_hostlist("node[5-2]")


@err("slurm: SLURM_PROCID not a number", ValueError, "malformed Slurm environment")
def _(d: Path) -> object:
    return SlurmClusterResolver({**SLURM, "SLURM_PROCID": "zero"})


@err("slurm: SLURM_PROCID outside SLURM_NTASKS", ValueError, "rank 5", "world size 2")
def _(d: Path) -> object:
    return SlurmClusterResolver({**SLURM, "SLURM_PROCID": "5"})


@ok("slurm: a host list of ranges", "every host, in order")
def _(d: Path) -> str:
    got = expand_hostlist("a[1-3,7],b[01-02]")
    if got != ["a1", "a2", "a3", "a7", "b01", "b02"]:
        raise Outcome("silent wrong", f"expanded to {got}")
    return "a[1-3,7],b[01-02] -> " + ",".join(got)


@err("simple resolver: task index outside num_workers", ValueError, "task_index=2", "num_workers=2")
def _(d: Path) -> object:
    return SimpleClusterResolver("127.0.0.1:2222", 2, 2)


@err(
    "simple resolver: an address without a port",
    ValueError,
    "SimpleClusterResolver address",
    "'host:port'",
)
def _(d: Path) -> object:
    return SimpleClusterResolver("127.0.0.1", 2, 0)


@err(
    "strategy: MultiWorkerMirroredStrategy on a bad TF_CONFIG",
    ValueError,
    "TF_CONFIG",
    "is not in the cluster",
)
def _(d: Path) -> object:
    import os

    import stratagem as sg

    os.environ["TF_CONFIG"] = json.dumps({"cluster": W2, "task": {"type": "worker", "index": 5}})
    return sg.MultiWorkerMirroredStrategy()


# --- the stratagem command ---------------------------------------------------------------------------
def _cli(d: Path, *argv: str) -> str:
    """``python -m stratagem ARGV``: it must exit 2 at once, one line naming the mistake, no traceback."""
    import os

    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("TF_CONFIG", None)
    (d / "x.py").write_text("print('never run')\n")  # the script exists: the mistake is elsewhere
    r = subprocess.run(
        [sys.executable, "-m", "stratagem", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=d,
        env=env,
    )
    if "Traceback" in r.stderr:
        raise Outcome("unclear error", "a traceback: " + r.stderr.strip().splitlines()[-1])
    if r.returncode != 2:
        raise Outcome("silent wrong", f"exit {r.returncode}: {r.stderr[-200:]}")
    return "CommandLineError: exit 2, " + r.stderr.strip().splitlines()[-1]


def _cli_case(name: str, argv: list[str], *needles: str) -> None:
    def fn(d: Path) -> str:
        text = _cli(d, *argv)
        missing = [n for n in needles if n not in text]
        if missing:
            raise Outcome("unclear error", f"{text} (does not say {missing})")
        return text

    R.add(
        name,
        fn,
        "CommandLineError (exit 2, one line, no traceback) " + ", ".join(repr(n) for n in needles),
        30.0,
    )


_cli_case("cli: run without a script", ["run"], "required: script")
_cli_case("cli: run -n 0", ["run", "-n", "0", "x.py"], "need -n >= 1", "-n 0")
_cli_case("cli: run -n x", ["run", "-n", "x", "x.py"], "invalid int value: 'x'")
_cli_case(
    "cli: run of a missing script", ["run", "-n", "2", "nope.py"], "no such script: 'nope.py'", "-m"
)
_cli_case(
    "cli: run of a missing script, ps cluster",
    ["run", "--workers", "1", "--ps", "1", "nope.py"],
    "no such script",
)
_cli_case("cli: an unknown option", ["run", "--bogus", "x.py"], "unrecognized arguments: --bogus")
_cli_case("cli: an unknown command", ["nosuchcmd"], "invalid choice: 'nosuchcmd'")
_cli_case(
    "cli: --max-restarts -1",
    ["run", "--max-restarts", "-1", "-n", "1", "x.py"],
    "--max-restarts must be >= 0",
    "-1",
)
_cli_case(
    "cli: --monitor-interval 0",
    ["run", "-n", "1", "--monitor-interval", "0", "x.py"],
    "--monitor-interval must be > 0",
)
_cli_case(
    "cli: --nnodes 2 without an endpoint",
    ["run", "--nnodes", "2", "-n", "1", "x.py"],
    "--rdzv-endpoint host:port",
)
_cli_case("cli: --node-rank outside --nnodes", ["run", "--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "127.0.0.1:1", "-n", "1", "x.py"], "--node-rank 5 is outside 0..1")  # fmt: skip
_cli_case(
    "cli: --workers without --ps",
    ["run", "--workers", "2", "x.py"],
    "needs both --workers N and --ps P",
)
_cli_case(
    "cli: -n with --workers",
    ["run", "-n", "2", "--workers", "2", "--ps", "1", "x.py"],
    "cannot be combined with --workers/--ps",
)
_cli_case("cli: --grace-period without a ps cluster", ["run", "-n", "1", "--grace-period", "3", "x.py"], "--grace-period applies to a parameter-server cluster")  # fmt: skip
_cli_case("cli: --rdzv-endpoint without a port", ["run", "-n", "1", "--rdzv-endpoint", "nohost", "x.py"], "expected 'host:port', got 'nohost'")  # fmt: skip
_cli_case("cli: demo --replicas 0", ["demo", "--replicas", "0"], "--replicas", "0")


@ok("cli: run -n 1 of a script that fails", "exit 1 naming the replica", bound=60.0)
def _(d: Path) -> str:
    import os

    (d / "bad.py").write_text("raise SystemExit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("TF_CONFIG", None)
    r = subprocess.run(
        [sys.executable, "-m", "stratagem", "run", "-n", "1", "bad.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=d,
        env=env,
    )
    if r.returncode != 1 or "replica 0 failed (exit code 3)" not in r.stderr:
        raise Outcome("unclear error", f"exit {r.returncode}: {r.stderr[-300:]}")
    return "stratagem run: replica 0 failed (exit code 3); exit 1"


SPECS = R.specs
