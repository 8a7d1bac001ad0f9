#!/usr/bin/env bash
# Issue 26 on the H200 (not run yet): sliding-window attention with KV blocks reclaimed behind
# the window. (1) the windowed Triton kernels compiled (tests/test_triton_swa.py) and the triton
# engine's greedy tokens against transformers past a 32-token window (tests/test_sliding_window.py);
# (2) a Mistral-7B-v0.1-shape model (dummy weights, 4096-token window) serving 64 requests of
# 32k tokens each in 20480 KV blocks of 16 tokens (40 GiB bf16): full attention would need
# 64 x 2048 = 131072 blocks (256 GiB), more than the GPU has; windowed, a decoding request
# holds at most 4096/16 + 1 = 257 blocks. Prints peak blocks in use, preemptions and tok/s.
#   device run:  bash scripts/gpu_swa.sh tests   then   bash scripts/gpu_swa.sh bench
#   (each under the 10-minute limit of one call; no argument runs both; files land in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
STAGE=${1:-all}
if [ "$STAGE" != bench ]; then
timeout 240 python3 -m pytest -q -x tests/test_triton_swa.py tests/test_sliding_window.py \
    -k "not interpreter" 2>&1 | tail -4
fi
M="examples/configs/mistral-7b-v0.1 --load-format dummy --block-size 16 --num-kv-blocks 20480"
if [ "$STAGE" != bench ]; then  # a quick look at the engine (16 x 8k)
timeout 150 python3 -m pagebatch.cli bench throughput $M --max-model-len 8192 \
    --num-prompts 16 --input-len 7936 --output-len 256 --max-num-seqs 16 \
    --output "$OUT/swa-16x8k.json" 2>&1 | grep -v "no tokenizer" | tail -4
fi
if [ "$STAGE" != tests ]; then  # the done-when workload (64 x 32k; warm-up + one timed run)
timeout 560 python3 -m pagebatch.cli bench throughput $M --max-model-len 32768 \
    --num-prompts 64 --input-len 32256 --output-len 512 --max-num-seqs 64 \
    --max-num-batched-tokens 8192 --output "$OUT/swa-64x32k.json" 2>&1 \
    | grep -v "no tokenizer" | tail -4
fi
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("swa-*.json")):
    r = json.loads(f.read_text())
    r = r[0] if isinstance(r, list) else r.get("results", [r])[0]
    print(f.stem, {k: r.get(k) for k in ("output_tok_s", "elapsed_s", "kv_peak_blocks",
                                         "kv_blocks", "num_preemptions", "kv_cache_tokens")})
PY
