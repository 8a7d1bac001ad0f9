#!/usr/bin/env bash
# Session 39, call A (one GPU): the GPU suites with piecewise CUDA graphs on by default (512
# tokens), then `pagebatch serve` over 8 and 32 req/s with PAGEBATCH_SLOW_STEP_MS=40 to find
# what holds every stream > 50 ms (session 38: goodput at 32 req/s 14.6 vs vLLM's 25.4), with
# piecewise graphs up to each of PWS (512 1024) tokens.
#   bash scripts/gpu-run bash scripts/gpu_s39a.sh        # carry .whl .gpu; files in $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== tests (t=$SECONDS s)"
    timeout ${TESTS_S:-150} python3 -m pytest -q -n 8 -rfE -p no:cacheprovider \
        tests/test_piecewise_graphs_gpu.py tests/test_cuda_graphs_gpu.py tests/test_step_copies.py \
        tests/test_sampler_gpu.py tests/test_triton_attention.py tests/test_kv_fp8.py \
        tests/test_pp_graph_replay.py tests/test_sliding_window.py tests/test_kv_hybrid.py \
        tests/test_stall_log.py tests/test_step_warmup.py > "$OUT/tests.log" 2>&1
    echo "   rc=$?"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | head -14 | cut -c1-300
fi
for pw in ${PWS:-512 1024}; do  # piecewise CUDA graphs up to pw tokens (512: the default)
    echo "== serve, piecewise $pw, with the stall log (t=$SECONDS s)"
    PAGEBATCH_SLOW_STEP_MS=${SLOW_MS:-40} RATES=${RATES:-8,32} BENCH_S=150 TAIL=5 \
        bash scripts/gpu_serve.sh pagebatch stalls-pw$pw --max-num-seqs 256 \
        --piecewise-cuda-graph-max-tokens $pw ${PB_EXTRA:-}
    python3 scripts/stall_summary.py "$OUT/server-stalls-pw$pw.log" --top 10
done
echo "== done (t=$SECONDS s)"
