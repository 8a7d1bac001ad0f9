#!/usr/bin/env bash
# Session 44 (issue 23): `vllm serve` and two pagebatch configurations over the sweep of
# gpu_serve.sh, one after another on the same machine, in one call (after the eight staging
# calls of .vl/vllm-gpu, see its header; carry .whl .gpu .vl/vllm-gpu):
#   bash scripts/gpu_s44.sh fwd     vLLM, then A, then B
#   bash scripts/gpu_s44.sh rev     B, then A, then vLLM (the second run, order reversed so that
#                                   drift over the call does not favour one engine)
# A: --long-prefill-token-threshold 256 --max-mixed-prefill-tokens 8192 (session 42's L = 256,
#    which led vLLM at every rate but TTFT at 8 req/s and ITL p99 at inf, plus a cap that the
#    step model says halves the saturated step for 0.2 % of throughput)
# B: --max-mixed-prefill-tokens 4096 --piecewise-cuda-graph-max-tokens 2048 (session 43's best
#    light-load TTFT)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
A="--long-prefill-token-threshold 256 --max-mixed-prefill-tokens 8192"
B="--max-mixed-prefill-tokens 4096 --piecewise-cuda-graph-max-tokens 2048"
run=${1:?fwd|rev}
vl() {
    ( eval "$(bash .vl/vllm-gpu install | tail -1)" && export PYTHONPATH=/tmp/site:$PYTHONPATH &&
      env BENCH_S=${BENCH_S:-150} TAIL=8 bash scripts/gpu_serve.sh vllm "vllm-$run" --max-num-seqs 256 )
}
pb() { env BENCH_S=${BENCH_S:-150} TAIL=8 bash scripts/gpu_serve.sh pagebatch "$1-$run" --max-num-seqs 256 $2; }
if [ "$run" = fwd ]; then vl; pb A "$A"; pb B "$B"; else pb B "$B"; pb A "$A"; vl; fi
