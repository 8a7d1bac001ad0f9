#!/usr/bin/env bash
# Session 38, call A (one GPU): piecewise CUDA graphs' GPU tests, scripts/mixed_step.py on the
# 8B shape with them (session 37's call A, scripts/gpu_s37a.sh, ran it without them), then
# batch-1 decode on the three shapes in no packaged table (scripts/gpu_shapes.sh) after the
# autotuner's bucket fix (21d7846), from an empty user cache.
#   bash scripts/gpu-run bash scripts/gpu_s38a.sh        # logs and JSON in $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== tests (t=$SECONDS s)"
timeout 90 python3 -m pytest -q -x -n 4 -p no:cacheprovider tests/test_piecewise_graphs_gpu.py \
    tests/test_piecewise_graphs.py > "$OUT/tests.log" 2>&1
echo "   rc=$?"; tail -4 "$OUT/tests.log" | cut -c1-300
echo "== mixed piecewise (t=$SECONDS s)"
timeout 80 python3 scripts/mixed_step.py examples/configs/llama-3.1-8b --decodes 32 \
    --prefill-lens 64,448 --steps 20 --extra piecewise_cuda_graph_max_tokens=512 \
    --json "$OUT/mixed-pw.json" > "$OUT/mixed-pw.log" 2>&1
echo "   rc=$?"; grep -E "^\||Error|error|captured" "$OUT/mixed-pw.log" | head -12 | cut -c1-300
echo "== shapes (t=$SECONDS s)"
RUN_S=100 TOTAL_S=${SHAPES_S:-250} METHODS="bf16 awq gptq" bash scripts/gpu_shapes.sh
echo "== done (t=$SECONDS s)"
