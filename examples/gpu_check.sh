#!/usr/bin/env bash
# One-shot GPU check of atoll's Triton kernels, under ten minutes on one H200. Everything it
# prints also goes to one results file.
#
#   bash examples/gpu_check.sh [RESULTS]              # on the GPU machine (default gpu_check.txt)
#   TRITON_INTERPRET=1 bash examples/gpu_check.sh     # no GPU: the same steps in Triton's interpreter
#
# Steps (each under its own time limit; a failed or timed-out step is reported and the rest run):
#   1. the kernel tests (tests/test_kernels*.py): compiled on the GPU, against the torch references,
#      and a tiny MoE model's greedy tokens with the kernels on vs off
#   2. atoll bench kernels: each kernel vs its reference vs the HBM/compute floor, decode and prefill
#   3. a config sweep for fused_moe at two decode sizes, to check the table in kernels/configs.py
#   4. MARKED: single-GPU `atoll bench` of a random-weight MoE model with kernels off and on;
#      runs only once `atoll bench --help` shows the model bench (its --model option)
# Without a GPU, step 2 prints its one line (needs a GPU) and then runs --smoke; 3 is skipped.
# Exit status: the number of failed steps (0: all passed).
set -uo pipefail
cd "$(dirname "$0")/.."  # the repository root
RESULTS=${1:-gpu_check.txt}
: > "$RESULTS"
FAILED=0
START=$SECONDS
BUDGET=${BUDGET:-585}  # seconds for the whole script; a step that might pass it is skipped

log() { echo "$*" | tee -a "$RESULTS"; }

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  log ""
  if (( SECONDS - START + limit > BUDGET )); then
    log "=== $name: SKIPPED (its ${limit} s limit would pass the ${BUDGET} s budget)"
    return
  fi
  log "=== $name (limit ${limit} s): $*"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$RESULTS"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && FAILED=$((FAILED + 1))
  log "=== $name: exit $rc after $((SECONDS - t0)) s$([ "$rc" -eq 124 ] && echo ' (timed out)')"
}

# `atoll bench kernels` once launch/cmd_bench.py lists it; the same module run directly until then
if atoll bench --help 2>/dev/null | grep -qw kernels; then
  BENCH=(atoll bench kernels)
else
  BENCH=(python -m atoll.kernels.bench)
fi

GPU=$(python -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>/dev/null)
if [ -n "$GPU" ] && [ "${TRITON_INTERPRET:-0}" != "1" ]; then MODE=gpu; else MODE=interpreter; fi
log "atoll gpu_check: $(date -u +%FT%TZ), mode $MODE, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
log "$(python -c "import sys, torch; import importlib.metadata as m; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', m.version('triton'), '| cuda', torch.version.cuda)" 2>&1)"
[ "$MODE" = gpu ] && log "$(nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>&1)"

# 1. kernel tests: on the GPU the kernels compile; without one they run in the interpreter
step "kernel tests" 240 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_moe.py tests/test_kernels_model.py

# 2. the kernel bench
if [ "$MODE" = gpu ]; then
  step "bench kernels" 180 "${BENCH[@]}" --rep-ms 40
else
  step "bench kernels (no GPU: one line)" 60 "${BENCH[@]}"
  step "bench kernels --smoke (interpreter; times mean nothing)" 120 "${BENCH[@]}" --smoke
fi

# 3. does the config table hold up? time the candidate tiles at two decode sizes
if [ "$MODE" = gpu ]; then
  step "config sweep" 60 "${BENCH[@]}" --models deepseek-v3 --rows-per-expert 1,16 --prefill-tokens 0 --sweep --rep-ms 20
fi

# 4. ---- MARKED STEP: the model bench with kernels off and on -------------------------------
# Needs the single-GPU model bench (plain `atoll bench`, an MoE model with random weights). It
# runs only when `atoll bench --help` shows its --model option; adjust MODEL_BENCH_ARGS to the
# options that bench has once it exists.
MODEL_BENCH_ARGS=${MODEL_BENCH_ARGS:---model Mixtral-8x7B-v0.1 --random-weights --layers 2}
if [ "$MODE" = gpu ] && atoll bench --help 2>/dev/null | grep -q -- "--model"; then
  for kernels in torch auto; do
    ATOLL_KERNELS=$kernels step "model bench, ATOLL_KERNELS=$kernels" 45 atoll bench $MODEL_BENCH_ARGS
  done
else
  log ""
  log "=== model bench: SKIPPED ($([ "$MODE" = gpu ] && echo "atoll bench has no --model yet" || echo "needs a GPU"))"
fi

log ""
log "=== done in $((SECONDS - START)) s; failed steps: $FAILED; results in $RESULTS"
exit "$FAILED"
