#!/usr/bin/env bash
# Session 34, one call: the GPU tests of the files sessions 33-34 touched (structured output
# compiled off the step loop, precompile in worker processes, the windowed kernels) and the cost
# of a JSON schema on the Llama-3.1-8B shape with the asynchronous compile (issue 24).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
timeout 260 python3 -m pytest -q -n 4 -p no:cacheprovider -k "not interpreter" \
    tests/test_precompile.py tests/test_structured_output.py tests/test_structured_output_core.py \
    tests/test_triton_swa.py tests/test_sliding_window.py tests/test_sampler_gpu.py \
    > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
timeout 240 python3 scripts/bench_structured.py .gpu/llama-3.1-8b-tok --load-format dummy \
    --batch-sizes 1,64 --json "$OUT/structured.json" > "$OUT/structured.log" 2>&1
echo "structured rc=$?"
grep -E "passed|failed" "$OUT/tests.log" | tail -2
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-200 | head -10
tail -n 4 "$OUT/structured.log"
