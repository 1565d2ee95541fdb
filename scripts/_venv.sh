# Sourced by the two README commands: make .venv with everything pinned in constraints.txt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.stratagem-installed
want="$(cat pyproject.toml constraints.txt | sha1sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]"
  echo "$want" > "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
