"""A strategy that would have to re-run its program to start the other replicas, made where no
program can be re-run (a Jupyter kernel, `python -c`), stops with an error that points to
`sg.launch`, the README's answer for notebooks. In a kernel it used to re-run
ipykernel_launcher.py, which started a second kernel on the notebook's ports and killed it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CELL = """
import stratagem as sg
try:
    sg.MirroredStrategy("cpu", num_replicas=2)
except RuntimeError as e:
    print("ERROR", e)
"""


def _assert_points_to_launch(text: str) -> None:
    assert "cannot be re-run to start the other replicas" in text, text
    assert "sg.launch(train_fn, num_replicas=N)" in text, text
    assert "stratagem run -n N script.py" in text, text


@pytest.mark.timeout(60)
def test_python_c_gets_the_error_that_names_sg_launch():
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(CELL)], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERROR "), r.stdout + r.stderr
    _assert_points_to_launch(r.stdout)


@pytest.mark.timeout(120)
def test_a_notebook_kernel_gets_the_error_and_lives_on():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CELL), nbformat.v4.new_code_cell("print('kernel alive')")]
    nbclient.NotebookClient(nb, timeout=90, kernel_name="python3").execute()  # DeadKernelError before
    out = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert out.startswith("ERROR "), nb.cells[0].outputs
    _assert_points_to_launch(out)
    assert "".join(o.get("text", "") for o in nb.cells[1].outputs) == "kernel alive\n"
