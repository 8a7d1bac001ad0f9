#!/usr/bin/env bash
# Issue 22 item 4 on the GPU machine, one call: the sampler's GPU tests, its microbenchmark
# (scripts/bench_sampler.py), then T1 and T2 greedy and sampled (temperature 0.8, top-p 0.95,
# top-k 50, per-prompt seeds) alternately; a table last.   bash scripts/gpu_sampled.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
${SKIP_TESTS:+:} python3 -m pytest -q -x -p no:cacheprovider tests/test_order_keys.py \
    tests/test_argmax.py tests/test_step_copies.py 2>&1 | tail -3
python3 scripts/bench_sampler.py | tee "$OUT/sampler.md"
C8="examples/configs/llama-3.1-8b --load-format dummy --max-model-len 4096"
S="--temperature 0.8 --top-p 0.95 --top-k 50"
run() {  # name, command...
    local name=$1; shift
    echo "=== $name: $*"
    timeout 300 python3 -m pagebatch.cli bench "$@" --output "$OUT/$name.json" 2>&1 \
        | grep -v "no tokenizer" | tail -3
}
T1="throughput $C8 --max-num-batched-tokens 16384 --num-prompts 256 --input-len 512 --output-len 128"
run t1-greedy $T1; run t1-sampled $T1 $S; run t1-greedy2 $T1; run t1-sampled2 $T1 $S
T2="latency $C8 --input-len 128 --output-len 256"
run t2-greedy $T2; run t2-sampled $T2 $S
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("t*.json")):
    r = json.loads(f.read_text())
    r = r.get("pagebatch", r) if isinstance(r, dict) else r
    keys = [k for k in r if "tok" in k and isinstance(r[k], (int, float))]
    print(f.stem, {k: round(r[k], 1) for k in keys})
PY
