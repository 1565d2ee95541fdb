# Sourced by the two README commands: make .venv and install stratagem into it (editable), torch
# pinned by constraints.txt. STRATAGEM_EXTRAS names the extras: scripts/demo.sh asks for "demo"
# (scikit-learn and matplotlib: what the demo needs, a few minutes less than the developer set),
# scripts/test.sh for the default "dev" (the test suite, lint and types). A .venv that already has
# the developer set serves the demo as it is (dev holds every package of demo).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
extras=${STRATAGEM_EXTRAS:-dev}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.stratagem-installed   # "<hash of pyproject.toml and constraints.txt> <extras>"
want="$(cat pyproject.toml constraints.txt | sha1sum | cut -d' ' -f1)"
have="$(cat "$stamp" 2>/dev/null || true)"
if [ "$have" != "$want $extras" ] && [ "$have" != "$want dev" ]; then
  echo "installing stratagem[$extras] into .venv (torch pinned by constraints.txt)" >&2
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[$extras]"
  echo "$want $extras" > "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
