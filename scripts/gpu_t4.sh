#!/usr/bin/env bash
# T4 (the nano-vllm workload) for two trees, interleaved old/new twice, three timed runs each:
# a second look at a 1 % difference. Same set-up as scripts/gpu_ab.sh (carry .gpu/old).
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=${1:-.gpu/old}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_CACHE_DIR=/tmp/tc-ab
python3 -m pip uninstall -y -q pagebatch >/dev/null 2>&1
for t in old new; do
    src=$([ $t = old ] && echo "$OLD" || echo .)
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/pb_$t \
        "$src" >/tmp/pb_$t.log 2>&1 || { cat /tmp/pb_$t.log; exit 1; }
done
for round in 1 2; do
    for tree in old new; do
        dir=$([ $tree = old ] && echo "$OLD" || echo .)
        echo "=== t4 round $round ($tree)"
        (cd "$dir" && PYTHONPATH=/tmp/pb_$tree timeout 300 python3 -m pagebatch.cli bench \
            throughput examples/configs/qwen3-0.6b --load-format dummy --max-model-len 4096 \
            --max-num-batched-tokens 16384 --preset nanovllm --num-iters 3) 2>&1 \
            | grep -A1 "output tok/s" | tail -1
    done
done
