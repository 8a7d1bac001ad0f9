#!/usr/bin/env bash
# Session 37, call A (one GPU): where the time of a mixed prefill + decode step goes (issue 23:
# serving at 8-32 req/s loses to vLLM on TTFT / ITL p99), and a per-kernel profile of batch-1
# 4-bit decode on a shape in no table (issue 22 item 5: W4A16 at 34-48 % of its floor).
#   bash scripts/gpu-run bash scripts/gpu_s37a.sh        # logs and JSON in $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C8=examples/configs/llama-3.1-8b
run() {  # tag, limit s, command...
    local tag=$1 lim=$2; shift 2
    echo "== $tag (t=$SECONDS s)"
    timeout "$lim" "$@" > "$OUT/$tag.log" 2>&1
    echo "   rc=$?"
    grep -E "^\||^[a-z0-9 ]+: [0-9]|steps: wall|ms/step|trace:" "$OUT/$tag.log" | head -40
}
run mixed-graphs 170 python3 scripts/mixed_step.py $C8 --decodes 32 --prefill-lens 64,512 \
    --json "$OUT/mixed-graphs.json"
run mixed-eager 130 python3 scripts/mixed_step.py $C8 --decodes 32 --prefill-lens 64,512 \
    --extra enforce_eager=true --json "$OUT/mixed-eager.json"
for m in "qwen2.5-7b awq" "qwen2.5-7b bf16"; do
    set -- $m
    q=""; [ "$2" != bf16 ] && q=",quantization=$2"
    run "prof-$1-$2" 120 python3 scripts/profile_engine.py examples/configs/$1 --num-prompts 1 \
        --input-len 128 --output-len 200 --decode-only --steps 40 --extra "max_num_seqs=16$q"
done
