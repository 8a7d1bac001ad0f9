#!/usr/bin/env bash
# Session 46 (issue 23): `pagebatch serve` with its own defaults (no step flags: since session 45
# they are max_mixed_prefill_tokens 4096 and piecewise graphs to 2,048 tokens) against `vllm
# serve`, both in one call, over gpu_serve.sh's sweep. After the staging calls of .vl/vllm-gpu
# (its header; carry .whl .gpu .vl/vllm-gpu):
#   bash scripts/gpu_s46.sh fwd     vLLM, then pagebatch
#   bash scripts/gpu_s46.sh rev     pagebatch, then vLLM (order reversed so that drift over a
#                                   call favours neither engine)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
run=${1:?fwd|rev}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
vl() {
    ( eval "$(bash .vl/vllm-gpu install | tail -1)" && export PYTHONPATH=/tmp/site:$PYTHONPATH &&
      env BENCH_S=${BENCH_S:-150} TAIL=8 bash scripts/gpu_serve.sh vllm "vllm-$run" --max-num-seqs 256 )
}
pb() { env BENCH_S=${BENCH_S:-150} TAIL=8 bash scripts/gpu_serve.sh pagebatch "S-$run" --max-num-seqs 256; }
if [ "$run" = fwd ]; then vl; pb; else pb; vl; fi
