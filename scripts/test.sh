#!/usr/bin/env bash
# The test suite: lint (ruff), types (mypy), then the main tier of tests (pytest, every test with a
# hard timeout; the 20 slowest are listed at the end). `bash scripts/test.sh --slow` runs the slow
# tier instead (longer multi-process cases, marked `slow`), `--matrix` the fault matrix
# (tests/faults/test_matrix.py, which writes its table into docs/MULTIWORKER.md); CI runs all
# three, see .ci/run. Other arguments go to pytest.
source "$(dirname "$0")/_venv.sh"
tier=(-m "not slow and not matrix")
if [ "${1:-}" = "--slow" ]; then
  shift
  tier=(-m slow)
elif [ "${1:-}" = "--matrix" ]; then
  shift
  tier=(-m matrix)
else
  echo "== ruff"; ruff check src tests benchmarks examples scripts
  echo "== mypy"; mypy
fi
# every process of a multi-process test imports these: compiled once here, not once per process
# (PYTHONDONTWRITEBYTECODE, set on some machines, would otherwise make each compile them again)
python -m compileall -q src tests > /dev/null
echo "== pytest ${tier[*]}"; exec python -m pytest -q --durations=20 "${tier[@]}" "$@"
