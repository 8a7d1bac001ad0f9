#!/usr/bin/env bash
# Session 38, call B (one GPU, a new machine after the cut-off try): piecewise CUDA graphs' GPU
# tests again (call A's bf16 cases failed on the near-tie rule of fp32; now a bf16 tie margin
# and a per-step hidden-state test), then batch-1 decode on Mistral-Nemo-12B (bf16 / awq / gptq),
# which call A had no time for, from an empty user cache.
#   bash scripts/gpu-run bash scripts/gpu_s38b.sh        # logs and JSON in $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
echo "== tests (t=$SECONDS s)"
timeout 150 python3 -m pytest -q -n 4 -rfE -p no:cacheprovider tests/test_piecewise_graphs_gpu.py \
    tests/test_piecewise_graphs.py > "$OUT/tests.log" 2>&1
echo "   rc=$?"; grep -E "passed|failed|^FAILED|^E  .*(part|Assert|assert)" "$OUT/tests.log" | head -12 | cut -c1-400
echo "== shapes (t=$SECONDS s)"
RUN_S=${RUN_S:-110} TOTAL_S=${SHAPES_S:-230} SHAPES="mistral-nemo-12b" bash scripts/gpu_shapes.sh
echo "== done (t=$SECONDS s)"
