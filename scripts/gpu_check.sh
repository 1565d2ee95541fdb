#!/usr/bin/env bash
# Everything a GPU user touches, in one command, on a machine with torch+CUDA preinstalled and no
# package index (runs from the source tree with PYTHONPATH=src; installs nothing):
#   bash scripts/gpu_check.sh [--dry-run] [--out FILE]
# Steps, in order, each under its own timeout (the whole run fits in 25 minutes on 1 H100 + 16
# cores): the whole suite with CUDA visible, `pytest -m gpu`, the demo and examples/quickstart.py
# on one GPU, then the GPU benchmarks. A failing step is recorded and the next one runs; the
# summary table (scripts/gpu_check_summary.py) is printed and written to FILE (default
# gpu_check.md, or $GPU_CHECK_OUT). Exit: 0 all passed or skipped, 1 a step failed, 2 no CUDA.
# --dry-run (or GPU_CHECK_DRY_RUN=1) runs no step: it lists them and writes the summary with every
# step skipped, to check the script itself on a machine without a GPU.
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}
OUT=${GPU_CHECK_OUT:-gpu_check.md}
DRY=${GPU_CHECK_DRY_RUN:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-1500}  # 25 minutes for all steps together
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) OUT=${2:?--out needs a file}; shift ;;
        --out=*) OUT=${1#--out=} ;;
        *) echo "gpu_check: unknown argument '$1' (use --dry-run, --out FILE)" >&2; exit 64 ;;
    esac
    shift
done
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" != 1 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device visible to '$PY' (torch.cuda.is_available() is False); nothing run."
    exit 2
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
STEPS="$WORK/steps.tsv"
: >"$STEPS"
START=$SECONDS

# step NAME TIMEOUT_S COMMAND...: run it (or skip it in a dry run), record status and log.
step() {
    local name=$1 cap=$2; shift 2
    local log="$WORK/$name.log" left=$((BUDGET - (SECONDS - START))) t0=$SECONDS rc status
    if [ "$DRY" = 1 ]; then
        echo "dry run: would run (timeout ${cap}s): $*" >"$log"
        printf '%s\tskipped\t0\t0\t%s\n' "$name" "$log" >>"$STEPS"
        echo "== $name: skipped (dry run): $*"
        return
    fi
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -le 0 ]; then
        echo "budget of ${BUDGET}s spent before this step" >"$log"
        printf '%s\tskipped\t0\t0\t%s\n' "$name" "$log" >>"$STEPS"
        echo "== $name: skipped (budget spent)"
        return
    fi
    echo "== $name (timeout ${cap}s): $*"
    timeout -k 15 "$cap" "$@" >"$log" 2>&1
    rc=$?
    case $rc in
        0) status=passed ;;
        124|137) status=timeout; echo "timed out after ${cap}s" >>"$log" ;;
        *) status=failed ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" "$log" >>"$STEPS"
    echo "   $status (exit $rc, $((SECONDS - t0)) s, log $log)"
}

# skip NAME REASON: record a step that cannot run here.
skip() {
    echo "$2" >"$WORK/$1.log"
    printf '%s\tskipped\t0\t0\t%s\n' "$1" "$WORK/$1.log" >>"$STEPS"
    echo "== $1: skipped ($2)"
}

# caps sum to 1,620 s against the budget of 1,500 (a late step gets what is left): the suite (serial
# pytest) is the long pole; the benchmarks take well under theirs
step suite 690 "$PY" -m pytest -q -p no:cacheprovider
step pytest-gpu 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu
if [ "$DRY" = 1 ] || "$PY" -c 'import sklearn' >/dev/null 2>&1; then
    step demo 120 env CUDA_VISIBLE_DEVICES=0 "$PY" -m stratagem demo
else
    skip demo "scikit-learn is not installed (the demo's data); nothing is installed here"
fi
# the quickstart compiles its step (torch.compile): allow for inductor's first compile
step quickstart 120 env CUDA_VISIBLE_DEVICES=0 "$PY" examples/quickstart.py
step bench-fit-onedevice 150 env CUDA_VISIBLE_DEVICES=0 "$PY" benchmarks/fit_overhead.py \
    --device cuda --model resnet18 --batch 256 --precision bf16 --channels-last \
    --steps 50 --rounds 5 --threads 4 --onedevice
step bench-image-feed 180 env CUDA_VISIBLE_DEVICES=0 "$PY" benchmarks/image_pipeline.py \
    --device cuda --workers 8 --images 8192 --rounds 3
# nanoGPT through fit against train.py's loop at bf16 on one GPU: tokens/s and MFU per side (issue 33)
step bench-nanogpt-fit 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/real_models_fit.py --only mirrored --rounds 3 --updates 5
# 2 processes: on 2+ GPUs one each would be the real figure; these benchmarks run their replicas
# on CPU (gloo) beside the GPU, which is what a 1-GPU machine can check.
step bench-sharded 60 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/sharded.py --rounds 5
step bench-mirrored 60 "$PY" benchmarks/mirrored_vs_ddp.py --rounds 4

MACHINE=$("$PY" - <<'EOF' 2>/dev/null || echo "unknown (torch did not import)"
import os, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
n = torch.cuda.device_count()
print(f"{n} x {gpu}, torch {torch.__version__} (CUDA {torch.version.cuda}), {os.cpu_count()} cores")
EOF
)
echo
"$PY" scripts/gpu_check_summary.py "$STEPS" --out "$OUT" --machine "$MACHINE" || {
    echo "gpu_check: the summary failed; raw step results:"; cat "$STEPS"; exit 1; }
echo "logs: $WORK (total $((SECONDS - START)) s)"
if grep -qE "$(printf '\t')(failed|timeout)$(printf '\t')" "$STEPS"; then exit 1; fi
exit 0
