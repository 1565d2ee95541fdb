#!/usr/bin/env bash
# The flake census (issue 35): run the README's test command RUNS times, each on a fresh clone of
# this repository's HEAD (a new .venv too, as a new user gets it), every other run beside a CPU hog
# (one busy loop per core). One line per run goes to the log: pass/fail, minutes, load, and the
# failing tests; each run's whole output is kept beside it. Start it from a terminal (or with
# SIGINT at its default): a background job of a non-interactive shell inherits SIGINT ignored.
#   bash scripts/flake_census.sh [RUNS=5] [LOG=census.log]
# Repeat the multi-process tests instead with pytest-repeat, e.g.
#   bash scripts/test.sh -m "multiprocess and not slow" --count 20 -x tests/test_mirrored.py
set -uo pipefail
runs=${1:-5}
log=$(realpath -m "${2:-census.log}")
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$(dirname "$log")"
for i in $(seq "$runs"); do
  dir=$(mktemp -d /tmp/stratagem-census-XXXXXX)
  git clone -q "$repo" "$dir/repo"
  head=$(git -C "$dir/repo" rev-parse --short HEAD)
  hogs=()
  if (( i % 2 == 0 )); then
    for _ in $(seq "$(nproc)"); do python3 -c "while True: pass" & hogs+=($!); done
  fi
  start=$(date +%s)
  (cd "$dir/repo" && bash scripts/test.sh) > "$log.run$i" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  summary=$(grep -E "^[0-9]+ (passed|failed)|passed|failed" "$log.run$i" | tail -1)
  failures=$(grep -E "^FAILED|^ERROR" "$log.run$i" | cut -c1-200 | tr '\n' ';')
  echo "run $i of $runs at $head: rc=$rc ${secs}s hogs=${#hogs[@]} load=[$load] | $summary | $failures" >> "$log"
  rm -rf "$dir"
done
cat "$log"
