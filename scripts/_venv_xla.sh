# Sourced by scripts/test_xla.sh: make .venv-xla with torch==2.9.0 + torch-xla==2.9.0 (the newest
# torch-xla on the index pins torch 2.9.0, the CUDA build: ~4 GB, ~2 min). Reused between runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-xla/bin/python ]; then
  "$PY" -m venv .venv-xla
fi
stamp=.venv-xla/.stratagem-installed
want="$(cat pyproject.toml constraints-xla.txt | sha1sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv-xla/bin/python -m pip install -q -c constraints-xla.txt -e ".[tpu]" pytest pytest-timeout
  echo "$want" > "$stamp"
fi
