#!/usr/bin/env bash
# The XLA tests (TPUStrategy) on XLA's CPU backend, in their own environment (.venv-xla: torch 2.9.0
# + torch-xla 2.9.0, made once, ~4 GB). SPMD fixes the device count when the runtime starts, so
# each device count is its own pytest process.
source "$(dirname "$0")/_venv_xla.sh"
for n in 2 4; do
  echo "== XLA tests, PJRT_DEVICE=CPU CPU_NUM_DEVICES=$n"
  PJRT_DEVICE=CPU CPU_NUM_DEVICES=$n .venv-xla/bin/python -m pytest -q -p no:cacheprovider tests/xla "$@"
done
