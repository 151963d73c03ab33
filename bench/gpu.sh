#!/usr/bin/env bash
# One prepared GPU benchmark on one card (an H200 here when lent, or one RTX 4090), meant to take about 8 minutes
# (never run yet; its step limits bound it at 18, more than one 10-minute device command: run it in two if needed):
#   1. the bf16 matmul ceiling (8192², TFLOP/s),
#   2. training MFU of a DeepSeek-Coder-1.3B-architecture dense model, ZeRO-2 bf16, 1 GPU, random init,
#   3. training MFU of a DeepSeek-V2-Lite-shaped MoE cut to 8 layers (4.6B total / 1.1B active), same setup,
#   4. the MoE experts implementations (eager / grouped_mm; batched_mm is skipped at training sizes),
#   5. the longest sequence R1-Distill-Qwen-1.5B's architecture trains at on the card capped at 24 GiB (bench.long_context),
#   6. train.py itself: chat SFT, QLoRA under ZeRO-3 and GRPO on that architecture (bench.gpu_train), peak vs planned,
#      and evaluate.py on that base (its planner-chosen layout and rows per call), peak vs planned,
#   7. GRPO's generation backends (bench.grpo_rollout --gpu-preset),
# then merges everything into RESULTS_DIR/gpu.json and RESULTS_DIR/gpu.md.
#
#   bench/gpu.sh [RESULTS_DIR]          # default bench/results; per-step parts go to RESULTS_DIR/gpu/
#
# Without CUDA it prints why and exits 0 (nothing measured). Each step has its own time limit, so one that hangs or
# runs out of memory costs at most its limit and the report says which step did not finish. Nothing is downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-bench/results}"
PARTS="$RESULTS/gpu"
PY="${PYTHON:-python}"
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi

if ! "$PY" -m bench.gpu_bench check; then
    echo "bench/gpu.sh: skipped (no CUDA device); GPU figures stay 'not measured'."
    exit 0
fi
mkdir -p "$PARTS"
rm -f "$PARTS"/*.json
start=$SECONDS

step() {  # step LIMIT_SECONDS ARGS... : one python -m run with a hard time limit; a failure is reported, not fatal
    local limit=$1
    shift
    echo "== [$((SECONDS - start)) s] $* (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$PY" -m "$@"
    local rc=$?
    [ "$rc" -eq 0 ] || echo "bench/gpu.sh: '$*' failed or ran past ${limit} s (exit $rc)"
}

step 60 bench.gpu_bench matmul --out "$PARTS"
step 150 bench.gpu_bench train --case dense-1.3b --out "$PARTS"
step 150 bench.gpu_bench train --case moe-v2-lite-8l --out "$PARTS"
# 5. long sequences: the longest R1-Distill-Qwen-1.5B-architecture sequence (random init, bf16, all 28 layers, the
#    long-sequence savers on) that trains on this card capped at 24 GiB (a 4090's memory), beside the planner's bytes.
step 150 bench.long_context gpu-longest --model deepseek-r1-distill-qwen-1.5b --layers 28 --vocab 151936 --cap-gib 24 --out "$PARTS"
step 60 bench.experts_impl --sizes v2-lite-2l --seq-len 2048 --micro-batch 2 --iters 5 --tag gpu --results "$PARTS"
# 6. train.py itself, a few steps per job, and evaluate.py, each with its own limit inside (100 + 120 + 100 + 100 s)
#    after the base and data
#    (written to the part after each job, so a kill keeps what finished).
step 560 bench.gpu_train --out "$PARTS"
# 7. GRPO's rollout: one call per group, one batched call (Transformers' sampling and train.py's rows' own streams),
#    continuous batching; R1-Distill-Qwen-1.5B's architecture at random init, 8 prompts × G 4, 256 new tokens.
step 120 bench.grpo_rollout --gpu-preset deepseek-r1-distill-qwen-1.5b --repeats 2 --results "$PARTS"
"$PY" -m bench.gpu_bench report --out "$PARTS" --results "$RESULTS"
echo "bench/gpu.sh: done in $((SECONDS - start)) s; results in $RESULTS/gpu.md"
