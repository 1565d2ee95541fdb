"""The layers of docs/ARCHITECTURE.md: every import inside the package points down (or sideways
within its own layer); data and cluster import nothing else from stratagem."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "stratagem"

# what each layer may import from the package (besides itself)
ALLOWED = {
    "data": set(),
    "cluster": set(),
    "comm": {"cluster"},
    "pipeline": {"comm", "cluster"},
    "distribute": {"pipeline", "comm", "cluster", "data"},
    "train": {"distribute", "pipeline", "comm", "cluster", "data"},
    "testing": {"train", "distribute", "pipeline", "comm", "cluster", "data"},
    "cli": {"testing", "train", "distribute", "pipeline", "comm", "cluster", "data"},
}


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
            if node.module == "stratagem":  # from stratagem import data -> stratagem.data
                out += [(node.lineno, f"stratagem.{a.name}") for a in node.names]
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
