#!/usr/bin/env bash
# Session 37, call B (one GPU): piecewise CUDA graphs (core/piecewise_graphs.py) — their GPU
# tests and scripts/mixed_step.py on the 8B shape with them (call A, scripts/gpu_s37a.sh, was
# the eager baseline on an H100) — and batch-1 decode of Qwen2.5-7B (a shape in no packaged
# table) bf16 / awq after the autotuner's bucket fix, with an empty user cache.
#   bash scripts/gpu-run bash scripts/gpu_s37b.sh        # logs and JSON in $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C8=examples/configs/llama-3.1-8b
echo "== tests (t=$SECONDS s)"
timeout 100 python3 -m pytest -q -x -n 4 -p no:cacheprovider tests/test_piecewise_graphs_gpu.py \
    tests/test_cuda_graphs_gpu.py tests/test_piecewise_graphs.py > "$OUT/tests.log" 2>&1
echo "   rc=$?"; tail -4 "$OUT/tests.log"
echo "== mixed piecewise (t=$SECONDS s)"
timeout 90 python3 scripts/mixed_step.py $C8 --decodes 32 --prefill-lens 64,448 --steps 20 \
    --json "$OUT/mixed-pw.json" > "$OUT/mixed-pw.log" 2>&1
echo "   rc=$?"; grep -E "^\||Error|error" "$OUT/mixed-pw.log" | head -12
export PAGEBATCH_CACHE="$OUT/cache"; rm -rf "$PAGEBATCH_CACHE"
for m in awq bf16; do
    q=(); [ $m != bf16 ] && q=(--quantization $m)
    echo "== qwen2.5-7b $m (t=$SECONDS s)"
    timeout 85 python3 -m pagebatch.cli bench latency examples/configs/qwen2.5-7b \
        --load-format dummy --max-model-len 4096 --max-num-seqs 16 --input-len 128 \
        --output-len 256 --num-iters 1 "${q[@]}" --output "$OUT/qwen-$m.json" > "$OUT/qwen-$m.log" 2>&1
    echo "   rc=$?"; grep -E "^pagebatch|tok/s" "$OUT/qwen-$m.log" | tail -2
done
