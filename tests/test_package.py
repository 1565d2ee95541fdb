"""The package's names are imported on first use: each one the package names resolves to what its
defining module holds, and the `stratagem` command's launcher starts without importing torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

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
