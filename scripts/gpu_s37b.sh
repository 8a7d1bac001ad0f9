#!/usr/bin/env bash
# Session 37, call B (one GPU): piecewise CUDA graphs (core/piecewise_graphs.py) — their GPU
# tests, then scripts/mixed_step.py on the 8B shape with them (the default) and without
# (piecewise_cuda_graph_max_tokens=0), same call.
#   bash scripts/gpu-run bash scripts/gpu_s37b.sh        # logs and JSON in $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C8=examples/configs/llama-3.1-8b
echo "== tests (t=$SECONDS s)"
timeout 120 python3 -m pytest -q -x -n 4 -p no:cacheprovider tests/test_piecewise_graphs_gpu.py \
    tests/test_cuda_graphs_gpu.py tests/test_piecewise_graphs.py > "$OUT/tests.log" 2>&1
echo "   rc=$?"; tail -4 "$OUT/tests.log"
for v in 512 0; do
    echo "== mixed piecewise=$v (t=$SECONDS s)"
    timeout 95 python3 scripts/mixed_step.py $C8 --decodes 32 --prefill-lens 64,448 --steps 20 \
        --extra piecewise_cuda_graph_max_tokens=$v --json "$OUT/mixed-pw$v.json" \
        > "$OUT/mixed-pw$v.log" 2>&1
    echo "   rc=$?"; grep -E "^\||captured|Error|error" "$OUT/mixed-pw$v.log" | head -12
done
