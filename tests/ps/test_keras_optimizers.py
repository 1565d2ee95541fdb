"""sg.optimizers (Keras's recipes) under ParameterServerStrategy: the optimizer the ps tasks step
is the Keras one (its class travels by value, with its schedule and epsilon), so one worker equals
one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratagem.testing import run_script
from stratagem.testing.output import assert_clean_run

pytest.importorskip("cloudpickle")
SCRIPT = str(Path(__file__).parent / "ps_keras_optimizers.py")


def job(*args: str):
    argv = ["-m", "stratagem", "run", "--workers", "1", "--ps", "2", "--grace-period", "20", SCRIPT, *args]
    return run_script(argv, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", [
    "adam",
    pytest.param("sgd", marks=pytest.mark.slow),
    pytest.param("rmsprop", marks=pytest.mark.slow),  # with an ExponentialDecay schedule
])
def test_a_keras_optimizer_steps_on_the_ps_tasks_as_in_one_process(kind):
    r = job(kind)
    assert_clean_run(r, what=f"a parameter-server job with sg.optimizers ({kind})")
    assert "RESULT param_diff=0 loss_diff=0" in r.stdout, r.stdout


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_keras_recipe_given_to_compile_trains_as_in_one_process():
    r = job("adam", "fit")
    assert_clean_run(r, what="Model.compile(optimizer=sg.optimizers.Adam(...)) under ParameterServerStrategy")
    assert "RESULT history_diff=0 param_diff=0" in r.stdout, r.stdout
