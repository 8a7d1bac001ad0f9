#!/usr/bin/env bash
# Session 38, call C (one GPU): the piecewise GPU tests with a workload whose steps carry small
# prefill chunks (call B's greedy cases replayed the pieces once), then `pagebatch serve` (with
# the frontend's gc.freeze) over RATES (8,32,64) with piecewise graphs up to each of PWS (512 2048)
# tokens. Session 38 had time for `RATES=32,64 PWS=512 bash scripts/gpu-run bash scripts/gpu_s38c.sh`.
#   bash scripts/gpu-run bash scripts/gpu_s38c.sh        # carry .whl .gpu; files in $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== tests (t=$SECONDS s)"
timeout 150 python3 -m pytest -q -n 4 -rfE -p no:cacheprovider tests/test_piecewise_graphs_gpu.py \
    tests/test_piecewise_graphs.py > "$OUT/tests.log" 2>&1
echo "   rc=$?"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | head -12 | cut -c1-400
for pw in ${PWS:-512 2048}; do
    echo "== serve piecewise $pw (t=$SECONDS s)"
    RATES=${RATES:-8,32,64} BENCH_S=120 TAIL=6 bash scripts/gpu_serve.sh pagebatch pw$pw --max-num-seqs 256 \
        --piecewise-cuda-graph-max-tokens $pw
done
echo "== done (t=$SECONDS s)"
