#!/usr/bin/env bash
# Session 11, call B (issue 22): T2 / T3 greedy (the tuned shapes after the autotuner's rules),
# T1's roofline account, then batch-1 bf16 / awq / gptq on three shapes in no table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
for m in llama-3.1-8b llama-3.2-1b; do
    timeout 90 python3 -m pagebatch.cli bench latency examples/configs/$m --load-format dummy \
        --max-model-len 4096 --input-len 128 --output-len 256 --output "$OUT/lat-$m.json" 2>&1 \
        | grep -v "no tokenizer" | tail -1 | sed "s/^/$m batch 1: /"
done
C8="examples/configs/llama-3.1-8b --load-format dummy --max-model-len 4096"
T1="$C8 --max-num-batched-tokens 16384 --num-prompts 256 --input-len 512 --output-len 128"
timeout 120 python3 scripts/roofline.py $T1 --json "$OUT/roofline-t1.json" \
    --trace "$OUT/roofline-t1-trace.json.gz" > "$OUT/roofline-t1.log" 2>&1; echo "roofline rc=$?"
tail -20 "$OUT/roofline-t1.log"
TOTAL_S=${TOTAL_S:-250} RUN_S=110 bash scripts/gpu_shapes.sh 2>&1 | tail -25
