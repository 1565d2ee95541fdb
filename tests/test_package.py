"""The package's names are imported on first use: each one the package names resolves to what its
defining module holds, and the `stratagem` command's launcher starts without importing torch."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import stratagem as sg


def test_every_public_name_resolves_to_its_definition():
    for name in sg.__all__:
        value = getattr(sg, name)
        assert value is not None, name
        where = sg._DEFINED_IN.get(name)
        if where is not None:
            assert value is getattr(importlib.import_module(where), name), name
        elif name in sg._SUBMODULES:
            assert value is importlib.import_module(f"stratagem.{name}"), name
    assert set(sg.__all__) <= set(dir(sg))
    # the functions themselves, not the modules named like them (stratagem/train/fit.py, ...)
    assert callable(sg.fit) and callable(sg.function) and callable(sg.print)
    assert sg.distribute.MirroredStrategy is sg.MirroredStrategy  # a subpackage, by attribute


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'stratagem' has no attribute 'MirrorStrategy'"):
        sg.MirrorStrategy  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'MirrorStrategy' from 'stratagem'"):
        from stratagem import MirrorStrategy  # noqa: F401


LAUNCHER_IMPORTS = """
import sys
import stratagem
from stratagem.cli import run
from stratagem.cluster.ps_launch import PSJob
from stratagem.cli.main import main
try:
    main(["run", "--help"])
except SystemExit:
    pass
print("TORCH", "torch" in sys.modules)
"""


@pytest.mark.timeout(60)
def test_the_command_and_its_ps_launcher_do_not_import_torch():
    """`stratagem run --workers N --ps P` starts its tasks at once: importing torch took the
    launcher 3-4 s on this machine before any task started, and every task imports it again."""
    r = subprocess.run([sys.executable, "-c", LAUNCHER_IMPORTS], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "TORCH False", r.stdout


# --- packaging: what a user installs (issue 51, item 1) -------------------------------------


ROOT = Path(__file__).resolve().parents[1]
#: the extras a user is offered, each in the README's install table
USER_EXTRAS = {"demo", "plot", "tensorboard", "mlflow", "wandb", "launch", "tpu"}


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _install_section() -> str:
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"^## Install\n(.*?)^## ", readme, re.S | re.M)
    assert m is not None, "README.md has no '## Install' section"
    return m.group(1)


def test_license_is_an_spdx_expression_with_its_file():
    """setuptools>=77 takes `license = "Apache-2.0"` (PEP 639); the old table warned at each build."""
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    requires = _pyproject()["build-system"]["requires"]
    assert requires == ["setuptools>=77"], requires


def test_the_package_is_typed_and_its_version_is_one():
    assert (ROOT / "src" / "stratagem" / "py.typed").is_file()
    pyproject = _pyproject()
    assert pyproject["tool"]["setuptools"]["package-data"]["stratagem"] == ["py.typed"]
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "stratagem._version.__version__"}
    assert "Typing :: Typed" in pyproject["project"]["classifiers"]


def test_the_readme_opens_with_install_and_its_extras_table_is_pyprojects():
    readme = (ROOT / "README.md").read_text()
    assert readme.index("## Install") < readme.index("## Quickstart: two commands")
    assert all(not line.startswith("## ") for line in readme[: readme.index("## Install")].splitlines())
    section = _install_section()
    assert "pip install ." in section
    extras = set(_pyproject()["project"]["optional-dependencies"])
    table = set(re.findall(r"^\| `([a-z]+)`", section, re.M))
    assert USER_EXTRAS <= table <= extras, (table, extras)
    for name in USER_EXTRAS:  # what the table says an extra installs is what it installs
        row = next(line for line in section.splitlines() if line.startswith(f"| `{name}` |"))
        for requirement in _pyproject()["project"]["optional-dependencies"][name]:
            assert re.split(r"[<>=!\[ ]", requirement)[0] in row, (name, requirement, row)
    # examples/keras_way.py loads scikit-learn's digits: the table says it needs [demo]
    assert "from sklearn" in (ROOT / "examples" / "keras_way.py").read_text()
    demo_row = next(line for line in section.splitlines() if line.startswith("| `demo` |"))
    assert "examples/keras_way.py" in demo_row
    # the version the README shows is the package's
    shown = re.search(r"stratagem --version\s+# stratagem (\S+)", section)
    assert shown is not None and shown.group(1) == sg.__version__
    assert f"stratagem-{sg.__version__}-py3-none-any.whl" in section


def test_the_test_harness_says_it_is_for_tests():
    import stratagem.testing

    doc = stratagem.testing.__doc__ or ""
    assert "a testing utility, for tests only" in doc
    # and training code does not import it
    for path in (ROOT / "src" / "stratagem").rglob("*.py"):
        if "testing" in path.relative_to(ROOT / "src" / "stratagem").parts:
            continue
        assert "stratagem.testing" not in path.read_text(), path


def test_the_demo_command_installs_the_demo_extra_and_the_test_command_the_developer_set():
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert "STRATAGEM_EXTRAS=demo source" in demo
    assert "STRATAGEM_EXTRAS" not in (ROOT / "scripts" / "test.sh").read_text()  # the default: dev
    venv = (ROOT / "scripts" / "_venv.sh").read_text()
    assert 'extras=${STRATAGEM_EXTRAS:-dev}' in venv
    assert '-e ".[$extras]"' in venv and "-c constraints.txt" in venv
    dev = set(_pyproject()["project"]["optional-dependencies"]["dev"])
    assert set(_pyproject()["project"]["optional-dependencies"]["demo"]) <= dev  # dev serves the demo


def _build_wheel(dest: Path, tmp: Path) -> Path:
    """The wheel of a copy of the tree (no build/ left behind in the checkout), its build output."""
    src = tmp / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(dest), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheels = list(dest.glob("stratagem-*.whl"))
    assert len(wheels) == 1, wheels
    out = r.stdout + r.stderr
    assert "License classifiers are deprecated" not in out and "project.license` as a TOML table" not in out, out
    return wheels[0]


# in the slow tier: a fresh venv with torch in it (about 3 minutes on 2 cores, most of it
# unpacking torch). torch is pinned: an unpinned one pulls a multi-GB CUDA build.
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_wheel_installs_into_a_fresh_venv_and_runs_as_the_readme_says(tmp_path):
    wheel = _build_wheel(tmp_path / "dist", tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "stratagem/py.typed" in names
    assert f"stratagem-{sg.__version__}.dist-info/licenses/LICENSE" in names
    assert not any(n.endswith(".pyc") or n.startswith(("tests/", "scripts/")) for n in names)
    metadata = zipfile.ZipFile(wheel).read(f"stratagem-{sg.__version__}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    for extra in USER_EXTRAS:
        assert f"Provides-Extra: {extra}" in metadata

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "torch==2.13.0"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run([*pip, str(wheel)], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    command = str(venv / "bin" / "stratagem")
    r = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60, env=env)
    assert (r.returncode, r.stdout.strip()) == (0, f"stratagem {sg.__version__}"), r.stderr
    # without [demo]: one line naming the extra, at once, no replica started
    r = subprocess.run([command, "demo"], capture_output=True, text=True, timeout=60, env=env, cwd=str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "pip install 'stratagem[demo]'" in r.stderr, r.stderr
    assert r.stdout == ""
    # with it: the demo as the README runs it (one epoch here), its accuracy printed, exit code 0
    r = subprocess.run([*pip, f"{wheel}[demo]"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([command, "demo", "--epochs", "1"], capture_output=True, text=True, timeout=300,
                       env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("final held-out accuracy") == 1 and "2 replicas" in r.stdout, r.stdout
    assert (tmp_path / "demo_history.png").stat().st_size > 0
    # the installed package is the wheel's, not this checkout's
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import stratagem; print(stratagem.__file__)"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=str(tmp_path))
    assert str(venv) in r.stdout, r.stdout
