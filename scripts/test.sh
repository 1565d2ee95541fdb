#!/usr/bin/env bash
# The whole test suite: lint (ruff), types (mypy), tests (pytest, every test with a hard timeout).
source "$(dirname "$0")/_venv.sh"
echo "== ruff"; ruff check src tests benchmarks examples
echo "== mypy"; mypy
echo "== pytest"; exec python -m pytest -q "$@"
