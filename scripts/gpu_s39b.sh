#!/usr/bin/env bash
# Session 39, the one call it could get (one GPU), most needed first: the GPU suites with
# piecewise CUDA graphs on by default (512 tokens), issue 23's seed claims over HTTP
# (`gpu_claims.sh serve`: max_num_seqs 64 vs 256, a 4k shared prefix with the prefix cache on /
# off), then `pagebatch serve` at 32 req/s under the stall log (PAGEBATCH_SLOW_STEP_MS=40).
# Each part starts only while t < its limit, so the call ends inside the device tool's 600 s.
#   bash scripts/gpu-run bash scripts/gpu_s39b.sh        # carry .whl .gpu; files in $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== tests (t=$SECONDS s)"
timeout ${TESTS_S:-130} python3 -m pytest -q -n 8 -rfE -p no:cacheprovider \
    tests/test_piecewise_graphs_gpu.py tests/test_cuda_graphs_gpu.py tests/test_step_copies.py \
    tests/test_sampler_gpu.py tests/test_triton_attention.py tests/test_kv_fp8.py \
    tests/test_stall_log.py tests/test_step_warmup.py > "$OUT/tests.log" 2>&1
echo "   rc=$?"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | head -14 | cut -c1-300
if [ $SECONDS -lt ${CLAIMS_BEFORE:-200} ]; then
    echo "== claims serve (t=$SECONDS s)"
    bash scripts/gpu_claims.sh serve 2>&1 | grep -vE "^\s*$" | tail -40
fi
if [ $SECONDS -lt ${STALLS_BEFORE:-440} ]; then
    echo "== serve at 32 req/s with the stall log (t=$SECONDS s)"
    PAGEBATCH_SLOW_STEP_MS=40 RATES=32 BENCH_S=60 TAIL=4 \
        bash scripts/gpu_serve.sh pagebatch stalls --max-num-seqs 256
    python3 scripts/stall_summary.py "$OUT/server-stalls.log" --top 10
fi
echo "== done (t=$SECONDS s)"
