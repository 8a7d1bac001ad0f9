#!/usr/bin/env bash
# Sessions 12-13: pagebatch side by side with vLLM 0.24.0 on the H200 (after the staging calls of
# .vl/vllm-gpu, see its header).
#   bash scripts/gpu_vllm.sh quick     pagebatch serve, then vllm serve, over the rate sweep of
#                                      gpu_serve.sh
#   bash scripts/gpu_vllm.sh offline   T1 --compare vllm, batch-1 8B --compare vllm
#   bash scripts/gpu_vllm.sh lat1b     batch-1 1B --compare vllm
#   bash scripts/gpu_vllm.sh mixed     issue 22's mixed-length workload on the Qwen2.5-7B shape
#                                      (1000 prompts, input 16-1536, output 16-512) --compare vllm
# PB_EXTRA: more pagebatch flags (e.g. "--piecewise-cuda-graph-max-tokens 512").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
eval "$(bash .vl/vllm-gpu install | tail -1)"
export PYTHONPATH=/tmp/site:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
pip_e() { python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; }
pip_e
C8="examples/configs/llama-3.1-8b --load-format dummy --max-model-len 4096"
T1="$C8 --max-num-batched-tokens 16384 --num-prompts 256 --input-len 512 --output-len 128"
S="--temperature 0.8 --top-p 0.95 --top-k 50"
show() { grep -v "no tokenizer" | grep -E "^(pagebatch|vllm) |/ vllm|^throughput|^latency" | sed "s/^/$1: /"; }
if [ "$1" = quick ]; then  # both servers over the sweep of gpu_serve.sh
    BENCH_S=170 TAIL=8 bash scripts/gpu_serve.sh pagebatch pagebatch --max-num-seqs 256 ${PB_EXTRA:-}
    BENCH_S=170 TAIL=8 bash scripts/gpu_serve.sh vllm vllm --max-num-seqs 256
elif [ "$1" = offline ]; then  # T1 and batch-1 8B, each side by side in one command
    timeout 280 python3 -m pagebatch.cli bench throughput $T1 --compare vllm \
        --output "$OUT/t1-vllm.json" 2> "$OUT/t1-vllm.err" | show t1
    timeout 240 python3 -m pagebatch.cli bench latency $C8 --input-len 128 --output-len 256 \
        --compare vllm --output "$OUT/lat8b-vllm.json" 2> "$OUT/lat8b-vllm.err" | show lat-8b
    tail -n 3 "$OUT/t1-vllm.err" "$OUT/lat8b-vllm.err" | cut -c1-200
elif [ "$1" = mixed ]; then
    timeout 500 python3 -m pagebatch.cli bench throughput examples/configs/qwen2.5-7b \
        --load-format dummy --max-model-len 4096 --max-num-batched-tokens 16384 \
        --num-prompts 1000 --input-len-min 16 --input-len 1536 --output-len-min 16 \
        --output-len 512 ${PB_EXTRA:-} --compare vllm --output "$OUT/mixed-vllm.json" \
        2> "$OUT/mixed-vllm.err" | show mixed
    tail -n 3 "$OUT/mixed-vllm.err" | cut -c1-200
else  # batch-1 1B side by side
    timeout 240 python3 -m pagebatch.cli bench latency examples/configs/llama-3.2-1b \
        --load-format dummy --max-model-len 4096 --input-len 128 --output-len 256 \
        --compare vllm --output "$OUT/lat1b-vllm.json" 2> "$OUT/lat1b-vllm.err" | show lat-1b
    tail -n 3 "$OUT/lat1b-vllm.err" | cut -c1-200
fi
