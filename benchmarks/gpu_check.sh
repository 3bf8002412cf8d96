#!/usr/bin/env bash
# One prepared check of ple on a CUDA machine, within 10 minutes on one H200 (BUDGET seconds in all):
#   1. environment (torch sees a GPU; ple, transformers, triton, pytest import; else `pip install -e .[dev]`);
#   2. the Triton kernels against their references on the GPU (the Triton test files, run natively);
#   3. benchmarks/gpu_check.py: ids and gather as a fraction of peak HBM bandwidth, gate and conv per token, and
#      the engine call: no host synchronization with a prebuilt Batch (torch.cuda.set_sync_debug_mode
#      "error"), a decode step captured in a CUDA graph and replayed (equal to eager, timed);
#   4. the layer benchmark on the GPU (python -m ple.commands.bench --device cuda), side by side with transformers.
# Results (JSON + markdown + logs) go to $OUT, or ./out when OUT is unset. One summary table (every step,
# kernel, engine check and benchmark case) is printed at the end and written to $OUT/gpu_check.md.
#
# Environment knobs:
#   PLE_PEAK_BW        peak memory bandwidth in B/s for the fractions (default 4.8e12, H200; H100 SXM 3.35e12)
#   PYTHON             interpreter (default: .venv/bin/python when present, else python3)
#   SKIP_TESTS=1       skip step 2;  SKIP_KERNELS=1 skip step 3;  SKIP_LAYER=1 skip step 4
#   BUDGET             seconds for steps 2-4 together (default 560); a step gets what is left, at most:
#   TESTS_TIMEOUT, KERNELS_TIMEOUT, LAYER_TIMEOUT   seconds per step (defaults 200, 150, 220)
#   LAYER_ARGS         arguments of step 4 (default "--repeat 3 --max-repeat 3")
#   DRY_RUN=1          no GPU needed: steps 3 and 4 run on the CPU at tiny sizes (checks this script itself)
# Exit status: 0 when every step that ran passed; 1 when a step failed (the others still run); 2 when the
# machine cannot run the check at all.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT_DIR="${OUT:-$REPO/out}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
SUMMARY="$OUT_DIR/gpu_check.md"
: >"$LOG"

log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }
die() {
    log "ERROR: $*"
    exit 2
}

if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$REPO/.venv/bin/python" ]]; then
    PY="$REPO/.venv/bin/python"
else
    PY="$(command -v python3 || true)"
fi
[[ -n "$PY" ]] || die "no python interpreter found (set PYTHON)"
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET # the kernels must run natively on the GPU here
export PLE_PEAK_BW="${PLE_PEAK_BW:-4.8e12}"
export DRY_RUN="${DRY_RUN:-0}"
if [[ "$DRY_RUN" == 1 ]]; then
    DEVICE=cpu
    KERNEL_SIZE_ARGS=(--tiny --repeat 2 --warmup 1)
    LAYER_SIZE_ARGS=(--quick)
else
    DEVICE=cuda
    KERNEL_SIZE_ARGS=()
    LAYER_SIZE_ARGS=()
fi

# ------------------------------------------------------------------------------------------------ 1. environment
log "python: $PY; out: $OUT_DIR; peak bandwidth: $PLE_PEAK_BW B/s; device: $DEVICE"
if ! "$PY" -c "import torch, ple, transformers, triton, pytest, hypothesis" >>"$LOG" 2>&1; then
    log "missing packages: pip install -e .[dev]"
    "$PY" -m pip install -e ".[dev]" >>"$LOG" 2>&1 || die "pip install -e .[dev] failed (see $LOG)"
fi
PLOT_ARGS=()
if "$PY" -c "import matplotlib" >/dev/null 2>&1; then
    PLOT_ARGS=(--plot "$OUT_DIR/bench_$DEVICE.png")
else
    log "note: matplotlib is not installed, the layer benchmark writes no chart"
fi
ENV_PROBE='
import os, sys, torch, triton, transformers, ple
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"transformers {transformers.__version__}, ple {ple.__version__}, python {sys.version.split()[0]}")
if os.environ.get("DRY_RUN") == "1":
    print("DRY_RUN=1: kernels and layer run on the CPU at tiny sizes; nothing here measures a GPU")
elif not torch.cuda.is_available():
    print("torch.cuda.is_available() is False: this check needs a CUDA GPU")
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
'
"$PY" -c "$ENV_PROBE" 2>&1 | tee "$OUT_DIR/environment.txt" | tee -a "$LOG" >&2 ||
    die "no usable CUDA device (see $LOG)"

status=0
rows=()
DEADLINE=$((SECONDS + ${BUDGET:-560}))
run_step() { # name timeout command...
    local name="$1" limit="$2"
    shift 2
    local left=$((DEADLINE - SECONDS))
    if [[ $left -lt 30 ]]; then
        log "step $name: SKIPPED (the ${BUDGET:-560}s budget is spent)"
        rows+=("| step $name | SKIPPED (budget) | - | - |")
        status=1
        return
    fi
    [[ $left -lt $limit ]] && limit=$left
    log "step $name (at most ${limit}s): $*"
    local t0=$SECONDS rc=0
    timeout --signal=TERM --kill-after=30 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1 || rc=$?
    local took=$((SECONDS - t0))
    if [[ $rc -eq 0 ]]; then
        log "step $name: ok (${took}s)"
        rows+=("| step $name | ok | ${took}s | $name.log |")
    else
        if [[ $rc -eq 124 || $rc -eq 137 ]]; then
            log "step $name: TIMED OUT after ${limit}s"
        else
            log "step $name: FAILED (exit $rc)"
        fi
        tail -n 30 "$OUT_DIR/$name.log" | sed 's/^/    /' >&2 || true
        rows+=("| step $name | FAILED (exit $rc) | ${took}s | $name.log |")
        status=1
    fi
}

# ------------------------------------------------------------------------------------------------ 2. kernel tests
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
    tests=()
    for t in tests/test_ngram_triton.py tests/ops tests/table/test_lookup_triton.py tests/table/test_tiers.py; do
        if [[ -e "$t" ]]; then tests+=("$t"); else log "note: $t does not exist, skipped"; fi
    done
    if [[ ${#tests[@]} -gt 0 ]]; then
        run_step tests "${TESTS_TIMEOUT:-200}" "$PY" -m pytest -q -p no:cacheprovider -rs \
            --junitxml="$OUT_DIR/tests.xml" "${tests[@]}"
    fi
fi

# ------------------------------------------------------------------------------------------------ 3. kernel timings
if [[ "${SKIP_KERNELS:-0}" != 1 ]]; then
    run_step kernels "${KERNELS_TIMEOUT:-150}" "$PY" benchmarks/gpu_check.py --device "$DEVICE" --out "$OUT_DIR" \
        --peak-bw "$PLE_PEAK_BW" ${KERNEL_SIZE_ARGS[@]+"${KERNEL_SIZE_ARGS[@]}"}
fi

# ------------------------------------------------------------------------------------------------ 4. layer benchmark
if [[ "${SKIP_LAYER:-0}" != 1 ]]; then
    # shellcheck disable=SC2086  # LAYER_ARGS is a list of words on purpose
    run_step layer "${LAYER_TIMEOUT:-220}" "$PY" -m ple.commands.bench --device "$DEVICE" \
        ${LAYER_SIZE_ARGS[@]+"${LAYER_SIZE_ARGS[@]}"} --output "$OUT_DIR/bench_$DEVICE.json" \
        --markdown "$OUT_DIR/bench_$DEVICE.md" ${PLOT_ARGS[@]+"${PLOT_ARGS[@]}"} ${LAYER_ARGS:---repeat 3 --max-repeat 3}
fi

# ------------------------------------------------------------------------------------------------ summary
{
    echo "# ple GPU check"
    echo
    cat "$OUT_DIR/environment.txt"
    echo
    if [[ ${#rows[@]} -gt 0 ]]; then printf '%s\n' "${rows[@]}"; fi |
        "$PY" benchmarks/gpu_check.py --summary --out "$OUT_DIR" --device "$DEVICE"
    echo
    echo "Details: gpu_kernels.md, bench_$DEVICE.md and the step logs in $OUT_DIR; total ${SECONDS}s."
} >"$SUMMARY"
log "summary: $SUMMARY (exit $status)"
cat "$SUMMARY"
exit "$status"
