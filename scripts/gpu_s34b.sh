#!/usr/bin/env bash
# Session 34, one call: the GPU tests of sessions 33-34 (the hybrid KV cache manager with the
# triton backend and CUDA graphs, structured output compiled off the step loop, precompile, the
# windowed kernels), the cost of a JSON schema on the Llama-3.1-8B shape (issue 24), and a
# Qwen2.5-7B shape with 14 full + 14 windowed layers (4096-token window, dummy weights) serving
# 32 requests of 16k + 256 tokens in a 20 GiB KV cache with the hybrid manager and without it
# (issue 26). Files land in $OUT. Two calls on a warm machine (each under the 10-minute limit):
#   bash scripts/gpu_s34b.sh a   (tests, JSON schema)   then   bash scripts/gpu_s34b.sh b
STAGE=${1:-a}
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "$STAGE" = a ]; then
timeout 270 python3 -m pytest -q -n 4 -p no:cacheprovider -k "not interpreter" \
    tests/test_kv_hybrid.py tests/test_precompile.py tests/test_structured_output.py \
    tests/test_structured_output_core.py tests/test_sliding_window.py tests/test_cuda_graphs_gpu.py \
    > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
timeout 200 python3 scripts/bench_structured.py .gpu/llama-3.1-8b-tok --load-format dummy \
    --batch-sizes 1,64 --json "$OUT/structured.json" > "$OUT/structured.log" 2>&1
echo "structured rc=$?"
grep -E "passed|failed" "$OUT/tests.log" | tail -2
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-200 | head -10
tail -n 4 "$OUT/structured.log"
exit 0
fi
H="examples/configs/qwen2.5-7b-hybrid --load-format dummy --max-model-len 16640 --kv-cache-memory 20GiB
   --num-prompts 32 --input-len 16384 --output-len 256 --max-num-seqs 32 --num-iters 1"
timeout 250 python3 -m pagebatch.cli bench throughput $H --output "$OUT/hybrid.json" \
    > "$OUT/hybrid.log" 2>&1; echo "hybrid rc=$?"
timeout 250 python3 -m pagebatch.cli bench throughput $H --disable-hybrid-kv-cache-manager \
    --output "$OUT/whole.json" > "$OUT/whole.log" 2>&1; echo "whole rc=$?"
for f in hybrid whole; do echo "== $f"; grep -E "KV cache|tok/s|pagebatch " "$OUT/$f.log" | cut -c1-220 | tail -5; done
