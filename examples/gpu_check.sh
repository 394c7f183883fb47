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
#      runs only when `atoll bench --help` shows the model bench (its --model, --output-len)
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
step "kernel tests" 210 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_moe.py tests/test_kernels_model.py

# 2. the kernel bench
if [ "$MODE" = gpu ]; then
  step "bench kernels" 160 "${BENCH[@]}" --rep-ms 40
else
  step "bench kernels (no GPU: one line)" 60 "${BENCH[@]}"
  step "bench kernels --smoke (interpreter; times mean nothing)" 120 "${BENCH[@]}" --smoke
fi

# 3. does the config table hold up? time the candidate tiles at two decode sizes
if [ "$MODE" = gpu ]; then
  step "config sweep" 50 "${BENCH[@]}" --models deepseek-v3 --rows-per-expert 1,16 --prefill-tokens 0 --sweep --rep-ms 20
fi

# 4. ---- MARKED STEP: the model bench with kernels off and on -------------------------------
# Plain `atoll bench` (launch/bench_model.py) on a random-weight MoE checkpoint built here
# (Qwen3-MoE shaped, 4 layers, 32 experts, top-4), once with ATOLL_KERNELS=torch and once with
# the kernels (auto). Runs only when `atoll bench --help` shows that bench's --model and
# --output-len; edit MODEL_BENCH_ARGS if its options change.
MOE_DIR=${TMPDIR:-/tmp}/atoll-gpu-check-moe
MODEL_BENCH_ARGS=${MODEL_BENCH_ARGS:---batch 16 --input-len 128 --output-len 32 --rounds 2}
# ATOLL_ENGINE_ON_CUDA=1 once the engine places models on CUDA (today ModelRunner builds them
# on the CPU, where the kernels' auto mode takes the torch references, so this would measure
# nothing about the kernels)
if [ "$MODE" = gpu ] && [ "${ATOLL_ENGINE_ON_CUDA:-0}" = 1 ] && atoll bench --help 2>/dev/null | grep -q -- "--output-len"; then
  step "build a random-weight MoE checkpoint" 40 python -c "
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.for_model('qwen3_moe', vocab_size=32000, hidden_size=1024, intermediate_size=2816,
    moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
    head_dim=64, num_experts=32, num_experts_per_tok=4, decoder_sparse_step=1, norm_topk_prob=True,
    max_position_embeddings=1024, tie_word_embeddings=False)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(sys.argv[1])
print('saved', sys.argv[1])" "$MOE_DIR"
  for kernels in torch auto; do
    ATOLL_KERNELS=$kernels step "model bench, ATOLL_KERNELS=$kernels" 70 atoll bench --model "$MOE_DIR" $MODEL_BENCH_ARGS
  done
else
  log ""
  log "=== model bench: SKIPPED ($([ "$MODE" = gpu ] && echo "the engine does not run models on CUDA yet" || echo "needs a GPU"))"
fi

log ""
log "=== done in $((SECONDS - START)) s; failed steps: $FAILED; results in $RESULTS"
exit "$FAILED"
