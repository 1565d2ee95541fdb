#!/usr/bin/env bash
# The whole test suite: lint (ruff), types (mypy), tests (pytest, every test with a hard timeout),
# then the 20 slowest tests. Extra arguments go to pytest (e.g. `-m slow` for the slow tier only).
source "$(dirname "$0")/_venv.sh"
echo "== ruff"; ruff check src tests benchmarks examples scripts
echo "== mypy"; mypy
# every process of a multi-process test imports these: compiled once here, not once per process
# (PYTHONDONTWRITEBYTECODE, set on some machines, would otherwise make each compile them again)
python -m compileall -q src tests > /dev/null
echo "== pytest"; exec python -m pytest -q --durations=20 "$@"
