"""The layers of docs/ARCHITECTURE.md: every import inside the package points down (or sideways
within its own layer); core imports nothing else from stratagem, data and cluster only core;
inside distribute the rooms point down too (API < engines < strategies), with no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "stratagem"

# what each layer may import from the package (besides itself)
ALLOWED = {
    "core": set(),
    "data": {"core"},
    "cluster": {"core"},
    "comm": {"cluster", "core"},
    "pipeline": {"comm", "cluster", "core"},
    "distribute": {"pipeline", "comm", "cluster", "data", "core"},
    "train": {"distribute", "pipeline", "comm", "cluster", "data", "core"},
    "testing": {"train", "distribute", "pipeline", "comm", "cluster", "data", "core"},
    "cli": {"testing", "train", "distribute", "pipeline", "comm", "cluster", "data", "core"},
}

# the rooms of distribute, lowest first: a module may import only from its own room or below
ROOMS = {
    "api": 0,  # strategy, context, reduce_op, ownership, function (what users and train see)
    "engines": 1,  # data_parallel, mirror, input, pipeline (what strategies are made of)
    "setup": 1,  # join, bootstrap, devices, startup (meeting the peers, choosing devices)
    "strategies": 2,  # the final strategy classes
    "top": 3,  # current (the default strategy), loss, the package itself
}
API = {"strategy", "context", "reduce_op", "ownership", "function", "mixed_precision", "input_options", "partitioners",
       "determinism"}
SETUP = {"join", "bootstrap", "devices", "startup", "views"}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "stratagem" or parts[1:2] == ["_version"]:
        return None  # outside the package, or the version every layer may read
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else "top"


def imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # from stratagem.x import module -> stratagem.x.module (a name that is a module)
            folder = PACKAGE.parent.joinpath(*node.module.split("."))
            subs = [a.name for a in node.names if (folder / f"{a.name}.py").exists() or (folder / a.name).is_dir()]
            if node.module.startswith("stratagem") and subs:
                out += [(node.lineno, f"{node.module}.{name}") for name in subs]
                if len(subs) < len(node.names):
                    out.append((node.lineno, node.module))
            else:
                out.append((node.lineno, node.module))
    return out


def test_every_layer_directory_is_known():
    dirs = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert dirs <= set(ALLOWED), f"new layer(s) {dirs - set(ALLOWED)}: add them to ALLOWED and ARCHITECTURE.md"


def test_imports_point_down():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        here = layer_of(".".join(rel.parts))
        if here in (None, "top"):
            continue
        for line, target in imports(path):
            there = layer_of(target)
            if there is None or there == here:
                continue
            if there == "top" and here in ("cli", "testing"):
                continue
            if there == "top" or there not in ALLOWED[here]:
                bad.append(f"{rel}.py:{line} ({here}) imports {target} ({there})")
    assert not bad, "imports that point up or sideways across layers:\n" + "\n".join(bad)


def room_of(module: str) -> str:
    parts = module.split(".")
    assert parts[:2] == ["stratagem", "distribute"]
    if len(parts) == 2:
        return "top"
    if parts[2] in ("engines", "strategies"):
        return parts[2]
    if parts[2] in API:
        return "api"
    if parts[2] in SETUP:
        return "setup"
    return "top"


def test_distribute_rooms_point_down_without_circles():
    bad = []
    graph: dict[str, set[str]] = {}
    base = PACKAGE / "distribute"
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        here = room_of(name)
        for line, target in imports(path):
            if not target.startswith("stratagem.distribute"):
                continue
            if target == "stratagem.distribute" and name != "stratagem.distribute":
                bad.append(f"{rel}.py:{line} imports the distribute package from inside it")
                continue
            graph.setdefault(name, set()).add(target)
            there = room_of(target)
            if ROOMS[there] > ROOMS[here] or (here == "setup" and there == "engines") or (
                here == "engines" and there == "setup"
            ):
                bad.append(f"{rel}.py:{line} ({here}) imports {target} ({there})")
    assert not bad, "imports that point up inside distribute:\n" + "\n".join(bad)

    # no circle among the modules (``from package import module`` counts as the module)
    def edges(m: str) -> set[str]:
        out = set()
        for t in graph.get(m, ()):
            out.add(t)
        return out

    seen: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state = seen.get(m, 0)
        if state == 1:
            raise AssertionError("import circle: " + " -> ".join([*stack[stack.index(m):], m]))
        if state == 2:
            return
        seen[m] = 1
        for t in edges(m):
            visit(t, [*stack, m])
        seen[m] = 2

    for m in list(graph):
        visit(m, [])


def test_train_sees_strategies_through_their_interface():
    """train uses StrategyExtended's facts and methods, never an engine or a concrete strategy."""
    bad = []
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        for line, target in imports(path):
            if target.startswith(("stratagem.distribute.engines", "stratagem.distribute.strategies")):
                bad.append(f"{rel}.py:{line} imports {target}")
    assert not bad, "train reaching past the strategy interface:\n" + "\n".join(bad)
