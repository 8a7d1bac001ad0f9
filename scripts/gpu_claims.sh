#!/usr/bin/env bash
# Issue 23 item 3 on the H200: the seeds' tuning claims, Llama-3.1-8B shape, dummy weights.
#   bash scripts/gpu_claims.sh serve    max_num_seqs 64 vs 256 and a 4k shared prefix with the
#                                       prefix cache on / off (pagebatch serve + bench serve)
#   bash scripts/gpu_claims.sh offline  block size 8..128 short and 32k, fp8 KV at 32k,
#                                       gpu_memory_utilization 0.5 vs 0.9 (bench throughput)
#   bash scripts/gpu_claims.sh mem      only the gpu_memory_utilization pair
# Rows go to docs/tuning.md ("The seeds' claims, measured"); JSON in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "$1" = serve ]; then
    for s in 64 256; do  # 256 requests of 512 in / 128 out at once
        RATES=inf NUM=256 RANGE=0 TAIL=2 bash scripts/gpu_serve.sh pagebatch seqs$s --max-num-seqs $s
    done
    for pc in enable no-enable; do  # 4,096 shared tokens + 256 own, 128 out, 128 at once
        RATES=inf NUM=128 IN=256 PREFIX=4096 RANGE=0 MAXLEN=8192 TAIL=2 \
            bash scripts/gpu_serve.sh pagebatch prefix-$pc --$pc-prefix-caching
    done
    exit 0
fi
C8="examples/configs/llama-3.1-8b --load-format dummy"
b() {  # tag, then bench throughput flags
    local tag=$1; shift
    timeout 120 python3 -m pagebatch.cli bench throughput $C8 "$@" --output "$OUT/claim-$tag.json" \
        2>&1 | grep -v "no tokenizer" | grep -E "^pagebatch |KV cache" | tr '\n' ' ' | sed "s/^/$tag: /"
    echo
}
T1="--max-model-len 4096 --max-num-batched-tokens 16384 --num-prompts 256 --input-len 512 --output-len 128"
if [ "$1" = mem ]; then  # only the gpu_memory_utilization pair
    for u in 0.5 0.9; do b t1-mem$u --gpu-memory-utilization $u $T1; done
    exit 0
fi
for bs in 8 16 32 64 128; do
    b short-bs$bs --block-size $bs --max-model-len 4096 --num-prompts 256 --input-len 128 --output-len 128
    b long-bs$bs --block-size $bs --max-model-len 32768 --max-num-batched-tokens 16384 \
        --num-prompts 4 --input-len 32000 --output-len 256
done
b long-fp8 --kv-cache-dtype fp8 --max-model-len 32768 --max-num-batched-tokens 16384 \
    --num-prompts 4 --input-len 32000 --output-len 256
for u in 0.5 0.9; do b t1-mem$u --gpu-memory-utilization $u $T1; done
