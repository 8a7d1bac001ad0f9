#!/usr/bin/env bash
# Session 34, last call: the hybrid KV cache manager's GPU tests (triton backend, decodes in
# CUDA graphs that read each group's block tables; one process, results as they come), then the
# cost of a JSON schema on the Llama-3.1-8B shape with the asynchronous compile (issue 24).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PAGEBATCH_PRECOMPILE_WORKERS=auto
timeout 220 python3 -m pytest -q -p no:xdist -p no:cacheprovider -rA --tb=short \
    tests/test_kv_hybrid.py -k "gpu" > "$OUT/hybrid_tests.log" 2>&1; echo "hybrid tests rc=$?"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/hybrid_tests.log" | cut -c1-160 | tail -16
timeout 200 python3 scripts/bench_structured.py .gpu/llama-3.1-8b-tok --load-format dummy \
    --batch-sizes 1,64 --json "$OUT/structured.json" > "$OUT/structured.log" 2>&1
echo "structured rc=$?"
tail -n 5 "$OUT/structured.log" | cut -c1-200
