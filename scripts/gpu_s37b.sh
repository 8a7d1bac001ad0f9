#!/usr/bin/env bash
# Session 37, call B (one GPU; not run in session 37: no device time was left): piecewise CUDA graphs (core/piecewise_graphs.py) — their GPU
# tests and scripts/mixed_step.py on the 8B shape with them (call A, scripts/gpu_s37a.sh, ran
# the same without them) — and the batch-1 AWQ profile of Qwen2.5-7B (a shape in no packaged
# table) after the autotuner's bucket fix, from an empty user cache as in call A.
#   bash scripts/gpu-run bash scripts/gpu_s37b.sh        # logs and JSON in $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== tests (t=$SECONDS s)"
timeout 80 python3 -m pytest -q -x -n 4 -p no:cacheprovider tests/test_piecewise_graphs_gpu.py \
    tests/test_piecewise_graphs.py > "$OUT/tests.log" 2>&1
echo "   rc=$?"; tail -4 "$OUT/tests.log"
export PAGEBATCH_CACHE="$OUT/cache"; rm -rf "$PAGEBATCH_CACHE"
echo "== prof qwen2.5-7b awq (t=$SECONDS s)"
timeout 85 python3 scripts/profile_engine.py examples/configs/qwen2.5-7b --num-prompts 1 \
    --input-len 128 --output-len 200 --decode-only --steps 40 \
    --extra "max_num_seqs=16,quantization=awq" > "$OUT/prof-qwen-awq.log" 2>&1
echo "   rc=$?"; grep -E "steps: wall|ms/step" "$OUT/prof-qwen-awq.log" | head -6
echo "== mixed piecewise (t=$SECONDS s)"
timeout 75 python3 scripts/mixed_step.py examples/configs/llama-3.1-8b --decodes 32 \
    --prefill-lens 64,448 --steps 20 --extra piecewise_cuda_graph_max_tokens=512 \
    --json "$OUT/mixed-pw.json" > "$OUT/mixed-pw.log" 2>&1
echo "   rc=$?"; grep -E "^\||Error|error" "$OUT/mixed-pw.log" | head -12
