#!/usr/bin/env bash
# For the session after 13 (written in 13, not yet run), on a cold machine (an empty Triton cache): the start-up of the 1B shape
# with the warm-up's variants compiled in parallel (core/kernels/precompile.py), against the
# 79.7 s of call A's serial warm-up; then tests/test_precompile.py's GPU test.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PAGEBATCH_PRECOMPILE_WORKERS=auto  # off by default until this call has run
timeout 100 python3 -m pagebatch.cli bench latency examples/configs/llama-3.2-1b \
    --load-format dummy --max-model-len 4096 --input-len 128 --output-len 64 --num-iters 1 \
    --output "$OUT/lat1b-cold.json" > "$OUT/lat1b-cold.log" 2>&1; echo "lat1b rc=$?"
grep -E "precompiled|warmed up|captured|pagebatch  " "$OUT/lat1b-cold.log" | cut -c1-200
python3 -c "import json; r=json.load(open('$OUT/lat1b-cold.json'))['results'][0]; print({k: r[k] for k in ('startup_s','warmup_s','decode_tok_s')})"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_precompile.py > "$OUT/t.log" 2>&1
echo "test rc=$?"; tail -15 "$OUT/t.log" | cut -c1-300
